"""Data curation as MT-NLG did it, between export and preprocessing (launch/curate.py), on Ray.

text.py            normalisation and shingles the stages share
exact.py           exact duplicates
fuzzy.py           MinHash + LSH, candidates verified by exact Jaccard
quality.py         heuristics and a classifier
decontaminate.py   GPT-3's 13-gram rule
stages.py          the stages as functions of one batch of rows (what a Ray task runs)
pipeline.py        the options, and a piece's last pass (filters, its shard written)
engine.py          the run on Ray: scan, signatures, shuffles, filter, outputs
shuffle.py         rows grouped by key through the work folder, a task per key
workdir.py         the work folder (resume) and the outputs put into place
report.py          what each stage removed and why
"""
