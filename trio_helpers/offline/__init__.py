"""The offline PyTRIO backend: a deterministic, trainable numpy stand-in for the service.

Entry point: ``trio_helpers.connect("offline")``. See book/offline_backend.md.
"""
