"""Data curation as MT-NLG did it, between export and preprocessing (launch/curate.py).

text.py            normalisation and shingles the stages share
exact.py           exact duplicates
fuzzy.py           MinHash + LSH, candidates verified by exact Jaccard
quality.py         heuristics and a classifier
decontaminate.py   GPT-3's 13-gram rule
pipeline.py        the streaming passes
report.py          what each stage removed and why
"""
