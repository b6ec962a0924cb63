"""Small reference models used by the examples, tests and benchmarks."""
from ditorch.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
