"""An example WDE plugin: a pooler that concatenates mean and max pooling, and a workflow using it."""
