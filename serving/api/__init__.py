"""OpenAI-facing layer: request schemas, reasoning and DSML tool-call parsers, the FastAPI server and its CLI."""
