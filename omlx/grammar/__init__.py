"""Structured output: xgrammar on a torch stub, compiled grammars, logits masks."""
