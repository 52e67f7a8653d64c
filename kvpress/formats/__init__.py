"""File and memory formats that the rest of kvpress reads: nothing here imports another kvpress module."""
