"""An example WDE plugin: T5-encoder embedders (sentence-T5, GTR-T5), written against `wde.api` only."""
