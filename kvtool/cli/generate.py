"""`kvtool generate`: one prompt through the runtime, its answer printed (is the model real?)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.cli import app
from kvtool.cli.user_errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.typer_options import flag, toggle
from kvtool.errors import KvtoolError

MODEL, PROMPT = "Model and plan", "Prompt and sampling"


@app.command(cls=KvtoolCommand)
def generate(
    prompt: Annotated[str, flag("prompt", "The prompt text.", PROMPT)],
    plan: Annotated[Path | None, flag("plan", "A plan directory built by `kvtool build`.", MODEL)] = None,
    model: Annotated[str | None, flag("model", "preset:NAME, a checkpoint directory, a .gguf file or gguf:NAME, "
                                      "built on the fly.", MODEL)] = None,
    chat_template: Annotated[bool, toggle("chat_template", "Wrap the prompt as a user message in the plan's chat "
                                          "template.", PROMPT)] = False,
    max_tokens: Annotated[int, flag("max_tokens", "Tokens to generate at most.", PROMPT)] = 32,
    temperature: Annotated[float, flag("temperature", "0 is greedy.", PROMPT)] = 0.0,
    top_p: Annotated[float, flag("top_p", "Draw from the smallest set of tokens holding this much probability (1: "
                                 "every token).", PROMPT)] = 1.0,
    top_k: Annotated[int, flag("top_k", "Draw from the K most likely tokens (0: every token).", PROMPT)] = 0,
    seed: Annotated[int | None, flag("seed", "Seed of the draws: the same seed gives the same answer (default: "
                                     "a new one each run).", PROMPT)] = None,
) -> None:
    """Generate an answer to one prompt and print it."""
    with user_errors():
        if (plan is None) == (model is None):
            raise KvtoolError("give one of --plan DIR or --model NAME")
        from kvtool import LLM, SamplingParams
        from kvtool.config import ConfigError

        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed)
        except ConfigError as error:
            raise KvtoolError(f"--{error.field} {error.problem}") from None

        with LLM(model=str(plan) if plan is not None else model, max_batch_size=1) as llm:
            tokenizer = llm.tokenizer
            if chat_template and not getattr(tokenizer, "has_chat_template", False):
                raise KvtoolError("--chat_template needs a plan whose tokenizer has a chat template (a chat model's "
                                  "checkpoint or GGUF file); drop --chat_template to send the text as is")
            source = (tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat_template
                      else prompt)
            out = llm.generate(source, params)
        if out.error is not None:
            raise KvtoolError(f"the prompt could not run: {out.error}")
        typer.echo(out.outputs[0].text.strip())
