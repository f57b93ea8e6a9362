"""Where drafts come from: the n-gram drafter, the adaptive draft length, the tail's learned
draft head and its training."""
