"""`kvik gateway`: run the gateway, check its config, and manage API keys.

    kvik gateway --config gateway.yaml [--host H] [--port P]   (SIGHUP reloads the config)
    kvik gateway check-config gateway.yaml
    kvik gateway keys create --config gateway.yaml --name NAME [--role user|admin] [--models a,b]
                             [--rpm N] [--tpm N] [--token-budget N] [--team T]
    kvik gateway keys list --config gateway.yaml [--all]
    kvik gateway keys revoke --config gateway.yaml KEY_ID

Only argparse is imported at registration; the gateway modules load inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvik.gateway.config import GatewayConfig
    from kvik.gateway.keys import KeyStore


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gateway", help="run the gateway in front of model replicas; check its config; manage keys",
        description="An OpenAI-compatible gateway: keys, limits, routing, failover, caching, guardrails. "
                    "The running gateway re-reads its config file when it changes, on SIGHUP and on "
                    "POST /admin/config/reload (models, replicas, discovery, keys and limits change live; "
                    "host, port, storage, cache, metrics and tracing need a restart).")
    parser.add_argument("--config", default=None,
                        help="the gateway YAML file (re-read on change, SIGHUP and POST /admin/config/reload)")
    parser.add_argument("--host", default=None, help="interface to listen on (default: the config's, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: the config's, 8080)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(func=run_server)
    commands = parser.add_subparsers(dest="gateway_command", metavar="COMMAND")

    check = commands.add_parser("check-config", help="validate a config file; errors name the field")
    check.add_argument("file")
    check.set_defaults(func=check_config)

    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    key_commands = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    create = key_commands.add_parser("create", help="create a key and print its secret (shown only once)")
    _config_flag(create)
    create.add_argument("--name", required=True)
    create.add_argument("--role", choices=("user", "admin"), default="user")
    create.add_argument("--models", default=None, help="comma-separated model names this key may use (default: all)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute")
    create.add_argument("--tpm", type=int, default=None, help="tokens (prompt + completion) per minute")
    create.add_argument("--token-budget", type=int, default=None, help="lifetime token budget")
    create.add_argument("--team", default=None,
                        help="the tenant this key belongs to: keys of one team share cache entries")
    create.add_argument("--json", action="store_true", help="print the key as JSON")
    create.set_defaults(func=create_key)

    listing = key_commands.add_parser("list", help="list keys (never their secrets)")
    _config_flag(listing)
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=list_keys)

    revoke = key_commands.add_parser("revoke", help="revoke a key by id")
    _config_flag(revoke)
    revoke.add_argument("key_id")
    revoke.set_defaults(func=revoke_key)


def _config_flag(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: `kvik gateway --config F keys list` must keep the F given before the subcommand.
    parser.add_argument("--config", default=argparse.SUPPRESS, help="the gateway YAML file")


def _load(args: argparse.Namespace) -> GatewayConfig:
    from kvik.core.errors import ConfigError
    from kvik.gateway.config import load_config

    if not getattr(args, "config", None):
        raise ConfigError("--config: give the gateway YAML file")
    return load_config(args.config)


def run_server(args: argparse.Namespace) -> int:
    import logging

    from kvik.gateway.listeners import serve

    config = _load(args)
    host = args.host or config.host
    port = args.port or config.port
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if config.tracing.otlp_traces_endpoint:
        from kvik.core import tracing

        tracing.configure(tracing.TracingConfig(config.tracing.otlp_traces_endpoint, config.tracing.sample_ratio,
                                                service_name=config.tracing.service_name))
        log_format = tracing.log_format(log_format)
    logging.basicConfig(level=args.log_level.upper(), format=log_format)
    names = ", ".join(m.name for m in config.models)
    metrics = (f"; /metrics on http://{config.metrics.host or host}:{config.metrics.port}"
               if config.metrics.port is not None else "")
    print(f"kvik gateway: serving {names} on http://{host}:{port}{metrics}", file=sys.stderr, flush=True)
    serve(config, host=host, port=port, log_level=args.log_level, config_path=Path(args.config).resolve())
    return 0


def check_config(args: argparse.Namespace) -> int:
    from kvik.gateway.config import load_config

    config = load_config(args.file)
    print(f"{args.file}: OK")
    for model in config.models:
        aliases = f" (aliases: {', '.join(model.aliases)})" if model.aliases else ""
        found = model.discovery
        sources = ([f"DNS {found.dns.name}"] if found and found.dns else []) + (
            [f"file {found.file.path}"] if found and found.file else [])
        discovery = f" + discovered from {' and '.join(sources)}" if sources else ""
        print(f"  model {model.name}{aliases}: {len(model.replicas)} replica(s){discovery}, {model.balancing}")
    auth = "enabled" if config.auth.enabled else "disabled"
    database = config.database_url.split("://")[0]
    print(f"  auth: {auth}; database: {database}; redis: {'yes' if config.redis_url else 'no'}")
    return 0


def _with_keys(args: argparse.Namespace, action: Callable[[KeyStore], int]) -> int:
    from kvik.core.errors import KvikError
    from kvik.gateway.keys import KeyStore
    from kvik.gateway.storage import open_database

    db = open_database(_load(args).database_url)
    try:
        return action(KeyStore(db))
    except KvikError as exc:
        print(f"kvik gateway keys: error: {exc.message}", file=sys.stderr)
        return 2
    finally:
        db.close()


def create_key(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None

    def action(store: KeyStore) -> int:
        new = store.create(args.name, role=args.role, models=models, rpm=args.rpm, tpm=args.tpm,
                           token_budget=args.token_budget, team=args.team)
        if args.json:
            print(json.dumps({**new.key.to_public_dict(), "key": new.secret}))
        else:
            print(f"created {new.key.id} ({new.key.name}, role {new.key.role}); the key is shown only once:",
                  file=sys.stderr)
            print(new.secret)
        return 0

    return _with_keys(args, action)


def list_keys(args: argparse.Namespace) -> int:
    def action(store: KeyStore) -> int:
        keys = store.list(include_revoked=args.all)
        if args.json:
            print(json.dumps([key.to_public_dict() for key in keys]))
            return 0
        print(f"{'ID':22} {'NAME':20} {'ROLE':6} {'PREFIX':13} {'MODELS':16} {'RPM':>6} {'TPM':>8} STATE")
        for key in keys:
            models = ",".join(key.models) if key.models is not None else "*"
            state = "revoked" if key.revoked_at else "active"
            print(f"{key.id:22} {key.name[:20]:20} {key.role:6} {key.key_prefix:13} {models[:16]:16} "
                  f"{key.rpm or '-':>6} {key.tpm or '-':>8} {state}")
        return 0

    return _with_keys(args, action)


def revoke_key(args: argparse.Namespace) -> int:
    def action(store: KeyStore) -> int:
        key = store.revoke(args.key_id)
        print(f"revoked {key.id} ({key.name})")
        return 0

    return _with_keys(args, action)
