"""Tool calls and reasoning in model output: SGLang's `--tool-call-parser` and `--reasoning-parser` formats,
parsed whole and streamed, with streamed deltas that assemble to the whole parse. Pure text: no torch."""
