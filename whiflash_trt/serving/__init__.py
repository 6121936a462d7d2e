"""Serving an engine: the Triton Python-backend model (triton_model.py) and the Triton server launcher (server.py)."""
