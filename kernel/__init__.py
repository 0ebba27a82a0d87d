"""The fnkernel Jupyter kernel and IPython magics (SPEC §6); not built yet."""
