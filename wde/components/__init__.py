"""The components a workflow names, one module per kind."""
