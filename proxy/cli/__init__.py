"""The `trajproxy` command line: its parser and the proxy's own subcommands (serve, export)."""
