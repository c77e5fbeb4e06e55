"""Engine control: the vLLM server lifecycle and weight sync into the running server."""
