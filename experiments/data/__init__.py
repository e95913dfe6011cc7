"""The data sources of the experiments, one module each; every batch is a pure function of (seed, step).

    text     a byte-level token corpus (the running Python's stdlib, a text folder or nanoGPT .bin files):
             resumable windows, per-process global batches (the `lm` task)
    prepare  `python -m experiments.data.prepare`: jsonl / parquet / text documents to token shards + manifest
             (readers.py: inputs and work units; tokenizer.py: bytes or a Hugging Face tokenizer.json)
    tokens   the prepared shards as the `lm` task's data, with segment ids and positions from end-of-document tokens
    images   scikit-learn's bundled 8x8 digits: a fixed split, resumable sharded batches (`image_classification`)
    volumes  synthetic 3D volumes (cosmology-like regression, labelled segmentation) generated one spatial block
             at a time, users' .npy volume folders, and the sharded global batches built from them (`volume_*`)

The tasks of experiments/tasks.py read them; nothing here is downloaded.
"""
