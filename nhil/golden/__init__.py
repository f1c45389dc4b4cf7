"""Golden outputs: generation (PyTorch eager fp32), safetensors store, comparison metrics, tolerances."""
