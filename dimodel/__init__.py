"""What is trained: the model definitions (the project's LLaMA) and the datasets that feed them.

The lowest layer with ``diutil``: every other package may import it, it imports none of them."""
from dimodel.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
