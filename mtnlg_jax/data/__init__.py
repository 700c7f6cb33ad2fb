"""Data: tokenizers, Megatron indexed datasets, GPT samples, blends and the trainer's loader.

tokenizer.py          sentencepiece, a Hugging Face tokenizer.json, and load() / open_tokenizer()
                      of any kind
gpt2_bpe.py           GPT-2 BPE (Megatron's GPT2BPETokenizer)
tokenizer_error.py    the error every tokenizer raises
preprocess.py         raw text -> token ids -> indexed.py, on Ray
pieces.py             input files cut at line ends into the pieces Ray tasks take
ray_engine.py         the embedded (loopback) or joined Ray cluster curation and preprocessing use
stall.py              a Ray job that stops moving ends with one line (the transforms' heartbeat)
indexed.py            Megatron's .bin / .idx
identity.py           the tokenizer identity beside a .bin / .idx, the data stream's fingerprint
gpt_dataset.py        splits and samples (Megatron's GPTDataset)
blend.py              weighted blends of datasets
megatron_order.py     Megatron-LM's own sample order, index for index
batch.py              the batch layout on the mesh
packing.py            positions, segment ids and loss mask of packed documents
loader.py             batches on the mesh, step by step
corpus.py             the default corpus (King James Bible, Python standard library)
curate/               exact and fuzzy deduplication, quality, decontamination, on Ray
"""
