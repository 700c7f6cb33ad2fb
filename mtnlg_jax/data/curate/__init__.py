"""Data curation as MT-NLG did it, between export and preprocessing (launch/curate.py):
exact.py, fuzzy.py (MinHash + LSH), quality.py (heuristics + classifier), decontaminate.py
(GPT-3's 13-gram rule), pipeline.py (the streaming passes), report.py (what each removed)."""
