"""Loading a model: `load_model` (load.py) is the one entry point from a name or path to a built model and
its tokenizer. Behind it: checkpoint.py reads weights (an HF folder, or a GGUF file converted once or kept in
its block formats), gguf.py parses GGUF files, build.py makes the model on its device and binds its routes,
weights.py installs the tensors, tokenizer.py gives each thread its own tokenizer."""
from specfleet.runtime.loading.load import load_model

__all__ = ["load_model"]
