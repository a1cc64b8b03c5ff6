"""Stanford-style ColBERT (`HF_ColBERT` checkpoints) on WDE, written against `wde.api` alone."""
