"""verl post-training stack: plan and validate on CPU, execute on GPU clusters.

One module per pipeline stage; `python -m app <command>` is the only entry point.
"""

__version__ = "0.1.0"
