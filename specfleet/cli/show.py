"""Terminal presentation for the CLI: statistics and tokens coloured by origin."""
from __future__ import annotations

import sys

# target-made tokens plain; drafted tokens coloured per proposer, like the staged-speculation paper's Figure 3
_COLOURS = ["\033[32m", "\033[34m", "\033[35m", "\033[36m", "\033[33m"]
_RESET = "\033[0m"


def show_origins(tokenizer, out, file=sys.stdout) -> None:
    colours: dict[str, str] = {}
    for tok, origin in zip(out.token_ids, out.token_origins):
        piece = tokenizer.decode([tok], skip_special_tokens=True) if tokenizer is not None else f"<{tok}>"
        if origin == "target":
            file.write(piece)
        else:
            colour = colours.setdefault(origin, _COLOURS[len(colours) % len(_COLOURS)])
            file.write(f"{colour}{piece}{_RESET}")
    legend = ", ".join(f"{c}{name}{_RESET}" for name, c in colours.items())
    file.write(f"\n[plain = target{', ' + legend if legend else ''}]")


def print_stats(m: dict, file=sys.stderr) -> None:
    if not m:
        return
    parts = [f"drafted {m.get('drafted', 0)}", f"accepted {m.get('accepted', 0)}",
             f"acceptance {m.get('acceptance_rate', 0):.1%} ({m.get('per_token_acceptance', 0):.1%} of the tokens judged)",
             f"mean accepted length {m.get('mean_accepted_length', 0):.2f}",
             f"draft {m.get('draft_time_s', 0):.2f}s / verify {m.get('verify_time_s', 0):.2f}s",
             f"goodput {m.get('goodput_tok_s', 0):.1f} tok/s"]
    print("[spec] " + ", ".join(parts), file=file)
