"""Real serving engines, each started per trial in its own process group: the shared serving
loop (`served`), the engines (`vllm` with its prefill/decode deployment `vllm_pd` and router
`pd_router`, `llamacpp`, `mindie`, `openai`) and the process handling they share (`process`)."""
