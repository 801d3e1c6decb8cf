"""An EAGLE-1 draft layer on int8 weights as one native call on CPU: native.py."""
