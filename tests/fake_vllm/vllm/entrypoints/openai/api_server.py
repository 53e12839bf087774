"""`python -m vllm.entrypoints.openai.api_server --model MODEL ...` on the CPU stand-in: the same server as
`vllm serve` (entrypoints/cli/main.py), which `grpokit serve` starts this way."""

from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    main()
