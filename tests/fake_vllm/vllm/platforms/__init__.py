"""vLLM's `current_platform` on the CPU stand-in, which `grpokit serve` asks where vLLM will run.

The stand-in plays vLLM's GPU server (its NCCL weight-transfer endpoints, over gloo), so it says "cuda"; a test
that needs the CPU build's checks in a `grpokit serve` process sets STAND_IN_VLLM_PLATFORM=cpu."""

import os
from types import SimpleNamespace

current_platform = SimpleNamespace(device_type=os.environ.get("STAND_IN_VLLM_PLATFORM", "cuda"))
