"""`kvc passes`: the registered passes, their options and defaults."""

from __future__ import annotations

import click

from kvc.cli.options import json_option, pass_plugin_option
from kvc.cli.render import echo_json


@click.command("passes")
@pass_plugin_option
@json_option
def passes(as_json):
    """List the registered passes with their options (use them in --passes PIPELINE)."""
    from kvc.passes import DEFAULT_PIPELINE, registered
    from kvc.passes.framework.registry import declared, option_info

    data = {name: {"doc": (cls.__doc__ or "").strip().splitlines()[0], "options": option_info(cls),
                   "requires": list(declared(cls, "requires")), "ensures": list(declared(cls, "ensures"))}
            for name, cls in registered().items()}
    if as_json:
        echo_json({"default_pipeline": DEFAULT_PIPELINE, "passes": data})
        return
    for name, info in data.items():
        click.echo(f"{name}: {info['doc']}")
        for o in info["options"]:
            choices = f" [{'|'.join(map(str, o['choices']))}]" if o["choices"] else ""
            click.echo(f"    {o['name']}={o['default']}{choices}  {o['help']}")
        if info["requires"] or info["ensures"]:
            click.echo(f"    requires: {', '.join(info['requires']) or '-'}; ensures: {', '.join(info['ensures']) or '-'}")
    click.echo(f"\ndefault common pipeline: {DEFAULT_PIPELINE}; pipelines read like "
               "'lift-state{beam=keep},fuse-kvcache'")

