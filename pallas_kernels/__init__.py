"""Custom kernels, one folder per op (`tv_loss/`), each with a dispatch table in `api.py`."""
