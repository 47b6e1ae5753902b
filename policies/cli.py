"""`loragate policy …`: check a policy file offline, train the difficulty estimator, print the default.

loragate policy validate FILE            OK and a summary (exit 0), or the bad field's path (exit 1)
loragate policy train-difficulty DATA.jsonl --out model.json
                                         fit `policies.difficulty_learned` on labelled prompts and
                                         print its accuracy on a held-out share
loragate policy default [--json]         the built-in policy document, as YAML (or JSON)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from policies.default_policy import DEFAULT_POLICY
from policies.difficulty_learned import accuracy, read_examples, split, train
from policies.document import Policy, dump_policy, load_policy_file
from policies.framework import PolicyError, Profile


def describe_profile(profile: Profile) -> str:
    filters = ", ".join(f.name for f in profile.filters) or "none"
    scorers = ", ".join(f"{s.name}×{w:g}" for s, w in profile.scorers) or "none"
    return f"filters: {filters}; scorers: {scorers}; picker: {profile.picker.name}"


def describe(policy: Policy) -> list[str]:
    lines = [f"profiles ({len(policy.profiles)}, default {policy.default_profile!r}):"]
    lines += [f"  {name}: {describe_profile(p)}" for name, p in policy.profiles.items()]
    for name, alias in policy.aliases.items():
        bands = ", ".join(
            f"≤{t.max_score:g} → {t.model}" if t.max_score is not None else f"else → {t.model}"
            for t in alias.rungs
        )
        lines.append(f"alias {name!r}: {bands}; shift down above saturation {alias.saturation_threshold:g}")
    lines.append(f"difficulty estimator: {type(policy.estimator).__name__}")
    return lines


def _validate(args: argparse.Namespace) -> int:
    try:
        policy = load_policy_file(args.file)
    except PolicyError as e:
        print(f"{args.file}: invalid policy at {e.path}: {e.message}", file=sys.stderr)
        return 1
    print(f"OK {args.file}")
    print("\n".join(describe(policy)))
    return 0


def _train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        examples = read_examples(Path(args.data))
    except (OSError, ValueError) as e:
        print(f"cannot read training data: {e}", file=sys.stderr)
        return 1
    if not 0 <= args.holdout < 1:
        print("--holdout must be in [0, 1)", file=sys.stderr)
        return 1
    if len(examples) < 2:
        print("need at least 2 labelled examples", file=sys.stderr)
        return 1
    fit, held_out = split(examples, args.holdout, args.seed)
    with tqdm(total=args.epochs, desc="train-difficulty", unit="epoch", disable=args.quiet) as bar:

        def on_epoch(epoch: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.update(1)

        model = train(fit, n_buckets=args.buckets, epochs=args.epochs, seed=args.seed, on_epoch=on_epoch)
    model.save(Path(args.out))
    print(f"trained on {len(fit)} examples; wrote {args.out}")
    if held_out:
        print(f"held-out accuracy: {accuracy(model, held_out):.3f} on {len(held_out)} examples")
    else:
        print("held-out accuracy: n/a (no held-out examples)")
    return 0


def _default(args: argparse.Namespace) -> int:
    print(dump_policy(DEFAULT_POLICY, as_json=args.json), end="" if not args.json else "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loragate policy", description="check a policy file, train the difficulty estimator"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("validate", help="check a policy file (YAML or JSON) offline")
    check.add_argument("file")
    check.set_defaults(func=_validate)
    fit = sub.add_parser("train-difficulty", help="train the learned difficulty estimator")
    fit.add_argument("data", help='JSONL, one {"prompt": str, "label": 0|1|float, "max_tokens"?: int} a line')
    fit.add_argument("--out", required=True, help="where to write the model (JSON)")
    fit.add_argument("--holdout", type=float, default=0.2, help="share held out for accuracy (default 0.2)")
    fit.add_argument("--epochs", type=int, default=30)
    fit.add_argument("--buckets", type=int, default=2048, help="hashed feature buckets (default 2048)")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--quiet", action="store_true", help="no progress bar")
    fit.set_defaults(func=_train)
    default = sub.add_parser("default", help="print the built-in policy document")
    default.add_argument("--json", action="store_true", help="JSON instead of YAML")
    default.set_defaults(func=_default)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
