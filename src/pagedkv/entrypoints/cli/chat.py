"""``pagedkv chat``: an interactive conversation that streams the reply as it is generated.

Each line on stdin is a user turn; the whole conversation so far is rendered with the chat
template and sent as one request, so earlier turns come back as prefix-cache hits. Tokens are
printed as soon as the engine produces them (`LLMEngine.step` + incremental detokenization).
Lines starting with "/" are commands (``COMMANDS``); an unknown one is refused, never sent to
the model. ``DESCRIPTION`` is the user-facing help.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedkv.entrypoints.cli.generate import (
    CLIError,
    add_engine_args,
    add_sampling_args,
    fail,
    make_llm,
    sampling_params,
)

Message = dict[str, str]

COMMANDS: dict[str, str] = {
    "/help": "show this help",
    "/reset": "clear the conversation (keeps --system)",
    "/exit": "quit (also /quit, or end of input)",
}

DESCRIPTION = """\
Chat with the model: each line you type is a user turn, and the reply streams as it is
generated. The whole conversation is sent each turn, so earlier turns are served from the
prefix cache; when it outgrows the context, the oldest turns are dropped.

Commands: /help, /reset (clear the conversation, keep --system), /exit (or /quit, or end of
input). Any other line starting with "/" is refused as an unknown command; start a message
with "//" to send it with one leading "/". Ctrl-C during a reply stops that reply; at the
prompt it quits. A reply cut short by --max-tokens is marked so. --stats prints per-reply
figures (tokens, tok/s, cached prompt tokens) on standard error.
"""

BANNER = "pagedkv chat: type a message; /help lists commands, /exit quits."


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "chat",
        help="interactive chat with streamed replies",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--system", default=None, help="a system message that starts every conversation")
    p.add_argument("--stats", action="store_true", help="print per-reply statistics on stderr")
    add_sampling_args(p, max_tokens=256, temperature=0.7)
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


class ChatSession:
    """The conversation and the engine it streams from."""

    def __init__(self, llm: Any, params: Any, system: str | None, show_stats: bool = False) -> None:
        self.engine = llm.llm_engine
        self.tok = self.engine.tokenizer
        if self.tok is None or not self.tok.chat_template:
            raise CLIError("this model has no tokenizer chat template")
        # End-of-turn markers (<|im_end|>...) end a reply even where they are not the eos id.
        params.stop_token_ids = sorted(
            set(params.stop_token_ids or []) | set(self.tok.stop_token_ids)
        )
        self.params = params
        self.system = system
        self.history: list[Message] = []
        self.turn = 0
        self.show_stats = show_stats

    def reset(self) -> None:
        self.history.clear()

    def _messages(self) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def _prompt_ids(self) -> list[int]:
        """The rendered conversation; drops the oldest exchanges while it leaves too little room
        for the reply (``max_tokens``, or half the context when that is larger)."""
        max_len = self.engine.max_model_len
        limit = max_len - min(self.params.max_tokens or max_len, max_len // 2)
        while True:
            text = self.tok.apply_chat_template(self._messages(), add_generation_prompt=True)
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(ids) <= limit or len(self.history) <= 1:
                return ids
            del self.history[:2]  # one user + assistant exchange
            print("[context full: dropped the oldest turn]", file=sys.stderr)

    def reply(self, user: str, out: Any = None) -> str:
        """Stream the assistant's answer to ``user`` to ``out`` (stdout); returns it and records
        the turn."""
        from pagedkv.models.tokenizer import DetokenizeState

        out = out or sys.stdout
        self.history.append({"role": "user", "content": user})
        ids = self._prompt_ids()
        rid = f"chat-{self.turn}"
        self.turn += 1
        try:
            self.engine.add_request(rid, {"prompt_token_ids": ids}, self.params)
        except ValueError as e:
            self.history.pop()
            raise CLIError(str(e)) from None
        state = DetokenizeState(skip_special_tokens=self.params.skip_special_tokens)
        # Hold back a possible stop-string prefix: the engine cuts the text at a stop string, and
        # what was printed cannot be unprinted.
        holdback = max((len(s) for s in self.params.stop_strings), default=1) - 1
        seen = printed = 0
        final = None
        start = time.perf_counter()
        try:
            while final is None:
                for o in self.engine.step():
                    if o.request_id != rid:
                        continue
                    new = o.outputs[0].token_ids[seen:]
                    seen += len(new)
                    self.tok.decode_incremental(state, new, final=o.finished)
                    if o.finished:
                        final = o
                    upto = len(state.text) - (0 if o.finished else holdback)
                    if o.finished and isinstance(o.outputs[0].stop_reason, str):
                        upto = len(o.outputs[0].text)  # cut at the stop string
                    if upto > printed:
                        out.write(state.text[printed:upto])
                        out.flush()
                        printed = upto
        except KeyboardInterrupt:
            self.engine.abort_request(rid)
            print(" [stopped]", file=sys.stderr)
        out.write("\n")
        out.flush()
        text = state.text[:printed]
        self.history.append({"role": "assistant", "content": text.strip()})
        if final is not None and self._cut_by_max_tokens(final):
            print(f"[reply cut at --max-tokens {self.params.max_tokens}]", file=sys.stderr)
        if self.show_stats and final is not None and final.metrics is not None:
            dt = time.perf_counter() - start
            print(
                f"[{seen} tokens in {dt:.2f}s, {seen / dt:.1f} tok/s, ttft "
                f"{final.metrics.time_to_first_token:.2f}s, {final.num_cached_tokens}/{len(ids)} "
                f"prompt tokens cached]",
                file=sys.stderr,
            )
        return text

    def _cut_by_max_tokens(self, out: Any) -> bool:
        """The reply stopped because it reached ``max_tokens`` (not at a stop token, not at the
        end of the context)."""
        c = out.outputs[0]
        return c.finish_reason == "length" and len(c.token_ids) == self.params.max_tokens


def help_text() -> str:
    rows = [f"  {cmd:<8} {what}" for cmd, what in COMMANDS.items()]
    return "\n".join(["commands:", *rows, '  //text   send "/text" as a message'])


def handle_command(line: str, session: ChatSession) -> str | None:
    """Run a "/" command; returns "exit" to quit, None when handled. An unknown command is
    refused with a message (never sent to the model)."""
    cmd = line.split()[0].lower()
    if cmd in ("/exit", "/quit"):
        return "exit"
    if cmd == "/reset":
        session.reset()
        print("[conversation cleared]", file=sys.stderr)
    elif cmd == "/help":
        print(help_text(), file=sys.stderr)
    else:
        print(
            f"unknown command {cmd}: type /help for the commands, or //text to send a message "
            f"starting with /",
            file=sys.stderr,
        )
    return None


def run(args: argparse.Namespace) -> int:
    try:
        params = sampling_params(args)
    except CLIError as e:
        return fail("chat", e)
    interactive = sys.stdin.isatty()
    # Before the model loads, so the user knows what they are waiting for.
    print(BANNER, file=sys.stderr, flush=True)
    try:
        llm = make_llm(args, prog="chat")
        session = ChatSession(llm, params, args.system, args.stats)
    except CLIError as e:
        return fail("chat", e)
    while True:
        try:
            if interactive:
                line = input(">>> ")
            else:
                line = sys.stdin.readline()
                if not line:
                    break
        except (EOFError, KeyboardInterrupt):
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):
            if handle_command(line, session) == "exit":
                break
            continue
        if line.startswith("//"):
            line = line[1:]
        try:
            session.reply(line)
        except CLIError as e:
            print(f"pagedkv chat: error: {e}", file=sys.stderr)
    if interactive:
        print(file=sys.stderr)
    return 0
