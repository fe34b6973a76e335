"""Guardrails applied to requests before they leave the gateway: PII redaction and moderation."""
