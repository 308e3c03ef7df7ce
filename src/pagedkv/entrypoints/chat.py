"""``pagedkv chat``: an interactive conversation that streams the reply as it is generated.

Each line on stdin is a user turn; the whole conversation so far is rendered with the chat
template and sent as one request, so earlier turns come back as prefix-cache hits. Tokens are
printed as soon as the engine produces them (`LLMEngine.step` + incremental detokenization).

Commands: ``/reset`` clears the history (keeps ``--system``), ``/exit`` (or end of input)
quits. Ctrl-C during a reply stops that reply; at the prompt it quits. When the conversation
outgrows the context, the oldest turns are dropped. ``--stats`` prints per-reply figures
(tokens, tok/s, cached prompt tokens) on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedkv.entrypoints.generate import CLIError, add_engine_args, add_sampling_args, fail, make_llm, sampling_params

Message = dict[str, str]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="interactive chat with streamed replies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        params.stop_token_ids = sorted(set(params.stop_token_ids or []) | set(self.tok.stop_token_ids))
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
        if self.show_stats and final is not None and final.metrics is not None:
            dt = time.perf_counter() - start
            print(f"[{seen} tokens in {dt:.2f}s, {seen / dt:.1f} tok/s, ttft "
                  f"{final.metrics.time_to_first_token:.2f}s, {final.num_cached_tokens}/{len(ids)} "
                  f"prompt tokens cached]", file=sys.stderr)
        return text


def run(args: argparse.Namespace) -> int:
    try:
        params = sampling_params(args)
        llm = make_llm(args)
        session = ChatSession(llm, params, args.system, args.stats)
    except CLIError as e:
        return fail("chat", e)
    interactive = sys.stdin.isatty()
    if interactive:
        print("pagedkv chat: /reset clears the conversation, /exit quits.", file=sys.stderr)
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
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            print("[conversation cleared]", file=sys.stderr)
            continue
        try:
            session.reply(line)
        except CLIError as e:
            print(f"pagedkv chat: error: {e}", file=sys.stderr)
    if interactive:
        print(file=sys.stderr)
    return 0
