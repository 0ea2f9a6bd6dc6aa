"""`kvtool dataset ...`: generate synthetic workloads, import ShareGPT and request traces, describe a
dataset file."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtool.workloads import generators
from kvtool.workloads.stats import LengthStats, dataset_stats
from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.workloads.sharegpt import approximate_token_count, import_sharegpt
from kvtool.workloads.text import TextSource, text_abab, text_multi_turn, text_system_prompt
from kvtool.workloads.traces import DEFAULT_VOCAB_SIZE, TRACE_FORMATS, TraceImportOptions, import_trace
from kvtool.cli import app
from kvtool.cli.user_errors import USER_ERRORS, error_message, print_error, user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.typer_options import either, flag, toggle
from kvtool.cli.paths import check_writable_file

dataset_app = typer.Typer(help="Generate or import benchmark datasets (JSON Lines) and describe them.",
                          no_args_is_help=True)
app.add_typer(dataset_app, name="dataset")


@contextlib.contextmanager
def _user_errors(ctx: typer.Context) -> Iterator[None]:
    """user_errors(), with this command's options named as flags: a generator names its parameters
    (num_requests must be ...), which are the command's flags (--num_requests must be ...)."""
    try:
        yield
    except USER_ERRORS as error:
        # Only names with an underscore: 'output' or 'seed' are words of a message too.
        flags = {param.name: param.opts[0] for param in ctx.command.params
                 if param.opts and param.opts[0].startswith("--") and "_" in str(param.name)}
        message = error_message(error)
        if flags:
            message = re.sub(rf"(?<![-\w'\"])({'|'.join(flags)})(?![\w'\"])", lambda m: flags[m.group(1)], message)
        print_error(ValueError(message))
        raise typer.Exit(code=2) from None


def _writable_output(path: Path) -> Path:
    # Checked while the flags are parsed: before anything is generated or imported.
    with user_errors():
        return check_writable_file(path, "--output", "dataset.jsonl")


Output = Annotated[Path, flag("output", "The JSON Lines file to write.", show_default=False,
                              callback=_writable_output)]
Seed = Annotated[int, flag("seed", "Random seed: the same seed writes the same file.")]
Spread = Annotated[float, flag("length_spread", "Draw each length uniformly within +-this fraction (0.2 = +-20%).")]
MinTokenId = Annotated[int, flag("min_token_id", "Smallest token id drawn.")]
MaxTokenId = Annotated[int, flag("max_token_id", "Token ids are drawn below this (keep it within the model's vocabulary).")]
Text = Annotated[Path | None, flag("text", "Cut the prompts from this text file (real text; needs --plan) instead of "
                                   "drawing random token ids.")]
PlanDir = Annotated[Path | None, flag("plan", "With --text: the plan whose tokenizer encodes the text.")]
ChatTemplate = Annotated[bool, toggle("chat_template", "With --text: apply the plan's chat template (system and user "
                                      "messages, assistant header).")]


def _options(seed: int, length_spread: float, min_token_id: int, max_token_id: int) -> generators.GeneratorOptions:
    return generators.GeneratorOptions(seed=seed, min_token_id=min_token_id, max_token_id=max_token_id,
                                       length_spread=length_spread)


def _text_source(text: Path | None, plan: Path | None, chat_template: bool, min_token_id: int,
                 max_token_id: int) -> TextSource | None:
    """The text to cut prompts from, or None for random token ids."""
    if text is None:
        if plan is not None or chat_template:
            raise ValueError("--plan and --chat_template go with --text FILE (prompts cut from a text file)")
        return None
    if plan is None:
        raise ValueError("--text needs --plan DIR: the plan's tokenizer turns the text into token ids")
    defaults = generators.GeneratorOptions()
    if (min_token_id, max_token_id) != (defaults.min_token_id, defaults.max_token_id):
        raise ValueError("--min_token_id/--max_token_id bound random ids; with --text the tokenizer gives the ids")
    if not text.is_file():
        raise FileNotFoundError(f"text file {text} does not exist")
    return TextSource.from_file(text, _plan_tokenizer(plan), chat=chat_template)


def _write(output: Path, lines: list[dict]) -> None:
    write_jsonl(output, lines)
    sessions = {line["session_id"] for line in lines if "session_id" in line}
    detail = f" in {len(sessions)} sessions" if sessions else ""
    typer.echo(f"wrote {len(lines)} requests{detail} to {output}")


@dataset_app.command("system-prompt", cls=KvtoolCommand)
def system_prompt(
    ctx: typer.Context,
    output: Output,
    num_groups: Annotated[int, flag("num_groups", "Number of distinct system prompts.")] = 8,
    prompts_per_group: Annotated[int, flag("prompts_per_group", "Requests per system prompt.")] = 16,
    system_prompt_len: Annotated[int, flag("system_prompt_len", "System prompt length (tokens).")] = 512,
    question_len: Annotated[int, flag("question_len", "Question length after the system prompt (tokens).")] = 128,
    output_len: Annotated[int, flag("output_len", "Tokens to generate per request.")] = 64,
    shuffle: Annotated[bool, flag("shuffle", "Shuffle the requests instead of writing them group by group.")] = False,
    seed: Seed = 0, length_spread: Spread = 0.0, min_token_id: MinTokenId = 10, max_token_id: MaxTokenId = 1000,
    text: Text = None, plan: PlanDir = None, chat_template: ChatTemplate = False,
) -> None:
    """Groups of requests sharing a system prompt (like SGLang's generated-shared-prefix); with --text,
    passages of real text, each followed by its own questions about it."""
    with _user_errors(ctx):
        source = _text_source(text, plan, chat_template, min_token_id, max_token_id)
        options = _options(seed, length_spread, min_token_id, max_token_id)
        kwargs = dict(num_groups=num_groups, prompts_per_group=prompts_per_group, system_prompt_len=system_prompt_len,
                      question_len=question_len, output_len=output_len, shuffle=shuffle)
        _write(output, generators.generate_system_prompt(options, **kwargs) if source is None
               else text_system_prompt(source, options, **kwargs))


@dataset_app.command("multi-turn", cls=KvtoolCommand)
def multi_turn(
    ctx: typer.Context,
    output: Output,
    num_sessions: Annotated[int, flag("num_sessions", "Number of chat sessions.")] = 8,
    num_turns: Annotated[int, flag("num_turns", "Turns per session.")] = 4,
    user_turn_len: Annotated[int, flag("user_turn_len", "Tokens of each user message.")] = 64,
    answer_len: Annotated[int, flag("answer_len", "Tokens generated per turn.")] = 64,
    system_prompt_len: Annotated[int, flag("system_prompt_len", "System prompt before the first message (0: none).")] = 0,
    shared_system_prompt: Annotated[bool, toggle("shared_system_prompt", "One system prompt for every session "
                                                 "(the default).")] = False,
    per_session_system_prompt: Annotated[bool, toggle("per_session_system_prompt",
                                                      "One system prompt per session.")] = False,
    seed: Seed = 0, length_spread: Spread = 0.0, min_token_id: MinTokenId = 10, max_token_id: MaxTokenId = 1000,
    text: Text = None, plan: PlanDir = None, chat_template: ChatTemplate = False,
) -> None:
    """Multi-turn chat sessions: each turn's prompt is the history + the generated answer + a new message
    (with --text: questions about a passage of real text)."""
    with _user_errors(ctx):
        shared = either(shared_system_prompt, per_session_system_prompt, "shared_system_prompt",
                        "per_session_system_prompt") is not False
        source = _text_source(text, plan, chat_template, min_token_id, max_token_id)
        options = _options(seed, length_spread, min_token_id, max_token_id)
        kwargs = dict(num_sessions=num_sessions, num_turns=num_turns, user_turn_len=user_turn_len,
                      answer_len=answer_len, system_prompt_len=system_prompt_len, shared_system_prompt=shared)
        _write(output, generators.generate_multi_turn(options, **kwargs) if source is None
               else text_multi_turn(source, options, **kwargs))


@dataset_app.command("abab", cls=KvtoolCommand)
def abab(
    ctx: typer.Context,
    output: Output,
    prompt_len: Annotated[int, flag("prompt_len", "Length of each of the prompts A and B (tokens).")] = 1024,
    num_rounds: Annotated[int, flag("num_rounds", "Rounds of A, B.")] = 4,
    output_len: Annotated[int, flag("output_len", "Tokens to generate per request.")] = 16,
    seed: Seed = 0, length_spread: Spread = 0.0, min_token_id: MinTokenId = 10, max_token_id: MaxTokenId = 1000,
    text: Text = None, plan: PlanDir = None, chat_template: ChatTemplate = False,
) -> None:
    """Two prompts alternating A, B, A, B, ... (replay it with --mode sequential to see offloading);
    with --text, two passages of real text."""
    with _user_errors(ctx):
        source = _text_source(text, plan, chat_template, min_token_id, max_token_id)
        options = _options(seed, length_spread, min_token_id, max_token_id)
        kwargs = dict(prompt_len=prompt_len, num_rounds=num_rounds, output_len=output_len)
        _write(output, generators.generate_abab(options, **kwargs) if source is None
               else text_abab(source, options, **kwargs))


@dataset_app.command("random", cls=KvtoolCommand)
def random_prompts(
    ctx: typer.Context,
    output: Output,
    num_requests: Annotated[int, flag("num_requests", "Number of requests.")] = 64,
    input_len: Annotated[int, flag("input_len", "Prompt length (tokens).")] = 512,
    output_len: Annotated[int, flag("output_len", "Tokens to generate per request.")] = 64,
    seed: Seed = 0, length_spread: Spread = 0.0, min_token_id: MinTokenId = 10, max_token_id: MaxTokenId = 1000,
) -> None:
    """Independent random prompts with no shared prefix (the no-reuse baseline)."""
    with _user_errors(ctx):
        _write(output, generators.generate_random(_options(seed, length_spread, min_token_id, max_token_id),
                                                  num_requests=num_requests, input_len=input_len,
                                                  output_len=output_len))


@dataset_app.command("prefix-repetition", cls=KvtoolCommand)
def prefix_repetition(
    ctx: typer.Context,
    output: Output,
    num_prefixes: Annotated[int, flag("num_prefixes", "Number of distinct prefixes.")] = 4,
    prefix_len: Annotated[int, flag("prefix_len", "Prefix length (tokens).")] = 512,
    suffix_len: Annotated[int, flag("suffix_len", "Distinct suffix after the prefix (tokens).")] = 64,
    num_requests: Annotated[int, flag("num_requests", "Number of requests, spread evenly over the prefixes.")] = 64,
    output_len: Annotated[int, flag("output_len", "Tokens to generate per request.")] = 64,
    seed: Seed = 0, length_spread: Spread = 0.0, min_token_id: MinTokenId = 10, max_token_id: MaxTokenId = 1000,
) -> None:
    """A few prefixes, each repeated by many requests with their own suffix (shuffled)."""
    with _user_errors(ctx):
        _write(output, generators.generate_prefix_repetition(
            _options(seed, length_spread, min_token_id, max_token_id), num_prefixes=num_prefixes,
            prefix_len=prefix_len, suffix_len=suffix_len, num_requests=num_requests, output_len=output_len))


@dataset_app.command("import-sharegpt", cls=KvtoolCommand)
def import_sharegpt_command(
    ctx: typer.Context,
    source: Annotated[Path, typer.Argument(help="A local ShareGPT-style JSON file.", show_default=False)],
    output: Output,
    plan: Annotated[Path | None, flag(
        "plan", "Count answer tokens with this plan's tokenizer (default: approximate, characters / 4).")] = None,
    max_sessions: Annotated[int | None, flag("max_sessions", "Import at most this many conversations.")] = None,
    max_turns: Annotated[int | None, flag("max_turns", "Keep at most this many turns per conversation.")] = None,
    max_output_tokens: Annotated[int | None, flag("max_output_tokens", "Cap each turn's max_tokens.")] = None,
) -> None:
    """ShareGPT conversations -> multi-turn sessions (text prompts, max_tokens from the recorded answers)."""
    with _user_errors(ctx):
        count_tokens, method = approximate_token_count, "approximated as characters / 4"
        if plan is not None:
            tokenizer = _plan_tokenizer(plan)
            count_tokens, method = (lambda text: len(tokenizer.encode(text))), f"counted with the tokenizer of {plan}"
        result = import_sharegpt(source, count_tokens=count_tokens, max_sessions=max_sessions, max_turns=max_turns,
                                 max_output_tokens=max_output_tokens)
        if not result.lines:
            raise ValueError(f"{source} has no conversation with a human message followed by an answer")
        write_jsonl(output, result.lines)
        typer.echo(f"wrote {result.num_turns} turns in {result.num_sessions} sessions to {output} "
                   f"(skipped {result.num_skipped_conversations} conversations without a human-then-answer pair; "
                   f"answer lengths {method})")


@dataset_app.command("import", cls=KvtoolCommand)
def import_trace_command(
    ctx: typer.Context,
    source: Annotated[Path, typer.Argument(help="A request trace: Mooncake / AIPerf JSON Lines of hash ids, the Azure "
                                           "LLM inference CSV, or a CSV / JSON Lines of arrival times and prompts.",
                                           show_default=False)],
    output: Output,
    trace_format: Annotated[str, flag("format", f"{' | '.join(TRACE_FORMATS)}: the trace's format (ShareGPT: "
                                      "`kvtool dataset import-sharegpt`).", show_default=False)],
    block_size: Annotated[int, flag("block_size", "mooncake: tokens per hash id in the trace (the trace's block "
                                    "size, not kvtool's --tokens_per_block).")] = 512,
    shrink: Annotated[int, flag("shrink", "mooncake, azure: divide every prompt by F (a hash id becomes "
                                "block_size / F tokens), keeping which prompts share which blocks.")] = 1,
    vocab_size: Annotated[int | None, flag("vocab_size", f"Token ids made from hash ids are below it (default "
                                           f"{DEFAULT_VOCAB_SIZE}: valid in every common vocabulary).")] = None,
    plan: Annotated[Path | None, flag("plan", "Take the vocabulary (ids stay below its special tokens), "
                                      "max_seq_len and tokenizer (to measure text prompts) from this plan.")] = None,
    max_seq_len: Annotated[int | None, flag("max_seq_len", "Longest prompt + output tokens (default: the --plan's; "
                                            "none without one).")] = None,
    skip_too_long: Annotated[bool, toggle("skip_too_long", "Leave out (and count) requests longer than "
                                          "max_seq_len instead of stopping with an error.")] = False,
    max_output_tokens: Annotated[int | None, flag("max_output_tokens", "Cap each request's output tokens.")] = None,
    output_len: Annotated[int | None, flag("output_len", "csv: output tokens of rows without an output "
                                           "length.")] = None,
    write_token_ids: Annotated[bool, toggle("write_token_ids", "mooncake, azure: write every prompt's token ids "
                                            "(input_ids) instead of its hash ids, for tools that read the file "
                                            "themselves (the conversation trace: 500 MiB instead of 3 MiB, half a "
                                            "minute to load instead of half a second).")] = False,
) -> None:
    """A request trace -> a dataset whose lines carry their arrival_time_s (replay it with --mode trace)."""
    with _user_errors(ctx):
        special_ids, count_tokens = (), None
        if plan is not None:
            if vocab_size is not None:
                raise ValueError("give --vocab_size or --plan (whose vocabulary applies), not both")
            from kvtool.plan import load_plan  # noqa: PLC0415 - torch-free, but only needed here

            built = load_plan(plan, verify_checksum=False)
            config = built.model_config
            vocab_size = config.vocab_size
            special_ids = (*config.eos_token_ids, *([config.bos_token_id] if config.bos_token_id is not None else []))
            max_seq_len = max_seq_len or built.build_options.max_seq_len
            tokenizer = built.tokenizer

            def count_tokens(text: str) -> int:
                return len(tokenizer.encode(text))
        options = TraceImportOptions(block_size=block_size, shrink=shrink, vocab_size=vocab_size,
                                     special_token_ids=special_ids, max_seq_len=max_seq_len,
                                     skip_too_long=bool(skip_too_long), max_output_tokens=max_output_tokens,
                                     output_len=output_len, write_token_ids=bool(write_token_ids),
                                     count_tokens=count_tokens)
        result = import_trace(source, trace_format.lower(), output, options)
        typer.echo(result.describe(output, options.max_seq_len))


def _plan_tokenizer(plan: Path):
    """The tokenizer a plan was built with (read from the plan directory)."""
    from kvtool.plan import load_plan  # noqa: PLC0415 - torch-free, but only needed here

    return load_plan(plan, verify_checksum=False).tokenizer


def _length_cells(stats: LengthStats) -> list[str]:
    if not stats.count:
        return ["-"] * 5
    return [str(stats.min), f"{stats.mean:.1f}", f"{stats.p50:.0f}", f"{stats.p90:.0f}", str(stats.max)]


@dataset_app.command("stats", cls=KvtoolCommand)
def stats(
    ctx: typer.Context,
    dataset: Annotated[Path, typer.Argument(help="A JSON Lines dataset file.", show_default=False)],
    tokens_per_block: Annotated[int, flag("tokens_per_block", "Block size for the shared-prefix fraction.")] = 32,
) -> None:
    """Counts, length distributions and the shared-prefix fraction of a dataset."""
    with _user_errors(ctx):
        result = dataset_stats(load_dataset(dataset), tokens_per_block=tokens_per_block)
        console = Console()
        console.print(f"[bold]{dataset}[/]: {result.num_lines} requests, {result.num_sessions} sessions "
                      f"({result.num_session_turns} session turns), {result.num_text_prompts} text prompts"
                      + (" (not tokenized: left out of the token figures)" if result.num_text_prompts else ""),
                      soft_wrap=True, highlight=False)
        table = Table("tokens", "min", "mean", "p50", "p90", "max")
        table.add_row("prompt (with session history)", *_length_cells(result.prompt_tokens))
        table.add_row("new per line", *_length_cells(result.new_tokens))
        table.add_row("output", *_length_cells(result.output_tokens))
        console.print(table)
        fraction = result.shared_prefix_fraction
        console.print(f"shared prefix fraction: {'-' if fraction is None else f'{fraction:.1%}'} "
                      f"({result.shared_prefix_tokens} of {result.total_prompt_tokens} prompt tokens lie in full "
                      f"blocks of {result.tokens_per_block} tokens that an earlier prompt already has)",
                      soft_wrap=True, highlight=False)
