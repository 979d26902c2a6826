"""The HTTP side of sglang-morph: /morph/* routes in SGLang's server and their IPC messages."""
