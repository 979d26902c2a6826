"""Server plumbing the mechanisms share: ports for child processes that bind them later."""
