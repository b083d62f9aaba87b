"""Command-line interface: argument parsing into the library's config objects, one module per
subcommand group. Nothing in the library imports this package."""
