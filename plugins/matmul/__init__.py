"""The weight-streaming CPU matmul (stream.c, native.py)."""
