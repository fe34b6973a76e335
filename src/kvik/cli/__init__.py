"""`kvik` command line: each subcommand parses flags into a config and calls one layer below."""
