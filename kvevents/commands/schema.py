"""``kvevents schema``: the ``EventBatch`` schema's versions, their fingerprints and compatibility,
and their registration in a schema registry."""

from __future__ import annotations

import argparse
import json

from kvevents.commands._common import CommandError, add_output_flags, command, registry_settings

DESCRIPTION = """\
The wire contract: every version of the EventBatch Avro schema this release can read (the
shipped history in schemas/avro/history/, then the current one), with its CRC-64-AVRO
fingerprint (the 8 bytes after C3 01 in a single-object message) and whether each pair is
compatible both ways (Apache Avro's reader/writer check: a reader of one reads data written
with the other), which schema evolution requires (FULL_TRANSITIVE).

  show      the table (default)
  print     one version's full schema JSON
  register  register the versions, oldest first, under <topic>-value in a schema registry
            with compatibility FULL_TRANSITIVE (the registry refuses an incompatible one)
"""

EPILOG = """\
examples:
  kvevents schema
  kvevents schema print --version v1 | jq .fields[].name
  kvevents schema register -t kv-cache-events --schema-registry-url http://127.0.0.1:8081/apis/ccompat/v7
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``schema``."""
    parser = subparsers.add_parser(
        "schema",
        help="the EventBatch schema's versions, fingerprints, compatibility; register them in a registry",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", choices=["show", "print", "register"], default="show")
    parser.add_argument("--version", default="current", help="for 'print': v1, ..., or current (default)")
    parser.add_argument(
        "--topic", "-t", default="kv-cache-events", help="for 'register': subject <topic>-value"
    )
    parser.add_argument(
        "--subject", default=None, help="for 'register': the subject (default: <topic>-value)"
    )
    parser.add_argument(
        "--compatibility",
        default="FULL_TRANSITIVE",
        help="for 'register': the subject's compatibility level to set first ('' leaves it; default FULL_TRANSITIVE)",
    )
    parser.add_argument(
        "--schema-registry-url",
        default=None,
        metavar="URL",
        help="for 'register' (default: $KVEVENTS_SCHEMA_REGISTRY_URL)",
    )
    parser.add_argument(
        "-X", dest="kafka_config", action="append", default=[], type=_pair, metavar="KEY=VALUE",
        help="registry client settings, e.g. -X basic.auth.user.info=USER:PASSWORD",
    )  # fmt: skip
    add_output_flags(parser)
    parser.set_defaults(func=run)


def _pair(text: str) -> tuple[str, str]:
    from kvevents.commands._common import config_pair

    return config_pair(text)


@command("schema")
def run(args: argparse.Namespace) -> int:
    """Run ``kvevents schema``."""
    from kvevents.schema_versions import compatibility, register_versions, schema_versions

    versions = schema_versions()
    if args.action == "print":
        chosen = [v for v in versions if v.name == args.version]
        if not chosen:
            raise CommandError(f"no version {args.version!r}: {', '.join(v.name for v in versions)}", code=2)
        print(json.dumps(json.loads(chosen[0].text), indent=2))
        return 0
    if args.action == "register":
        registry = registry_settings(args)
        if registry is None:
            raise CommandError(
                "register needs --schema-registry-url (or $KVEVENTS_SCHEMA_REGISTRY_URL)", code=2
            )
        subject = args.subject or f"{args.topic}-value"
        try:
            ids = register_versions(registry, subject, versions, args.compatibility or None)
        except Exception as exc:  # noqa: BLE001 - the registry client's errors (HTTP, connection) vary
            raise CommandError(f"registering under {subject!r} at {registry['url']}: {exc}") from None
        if args.json:
            print(json.dumps({"subject": subject, "ids": {v.name: i for v, i in ids}}))
        else:
            for version, schema_id in ids:
                print(
                    f"{subject}: {version.name} (fingerprint {version.fingerprint}) has schema id {schema_id}"
                )
        return 0
    try:
        problems = {(r.name, w.name): compatibility(r, w) for r in versions for w in versions if r is not w}
    except RuntimeError as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print(json.dumps({
            "versions": [{"name": v.name, "fingerprint": v.fingerprint, "source": v.source} for v in versions],
            "compatibility": [
                {"reader": r, "writer": w, "compatible": not p, "problems": p} for (r, w), p in problems.items()
            ],
            "full_transitive": not any(problems.values()),
        }))  # fmt: skip
    else:
        print(f"{'version':<8} {'fingerprint':<16}  source")
        for v in versions:
            print(f"{v.name:<8} {v.fingerprint:<16}  {v.source}")
        for (reader, writer), found in problems.items():
            verdict = "reads" if not found else "CANNOT read: " + "; ".join(found)
            print(f"reader {reader} {verdict} data of writer {writer}")
        print("FULL_TRANSITIVE: " + ("yes" if not any(problems.values()) else "NO"))
    return 0 if not any(problems.values()) else 1
