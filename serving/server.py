"""`python -m serving.server --help`: the OpenAI-compatible server (see serving/api/cli.py)."""

from serving.api.cli import main

if __name__ == "__main__":
    main()
