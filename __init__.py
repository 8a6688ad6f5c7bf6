"""IQuestRT: inference runtime for IQuest-Q1 (the repository root is the `iquest` package)."""

__version__ = "0.1.0"
