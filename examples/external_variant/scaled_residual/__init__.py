"""An example of a residual variant that lives outside reslab (see `gated.py`)."""
