"""What each command does apart from its command line (daemon/cli/ parses and prints): verify, handoff and
the broker's own files, the queries and how their results look, inspect, produce and the sample store."""
