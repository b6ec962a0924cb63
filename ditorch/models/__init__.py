"""The project's models, under the name users import them by (defined in ``dimodel``)."""
from dimodel.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
