"""Integrations of dyncp with model libraries; each lives in its own module behind an extra.

``dyncp.integrations.hf``: Hugging Face ``transformers`` causal LMs (``pip install dyncp[hf]``).
Importing this package imports no model library; importing a submodule needs its extra.
"""

__all__: list[str] = []
