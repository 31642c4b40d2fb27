"""The domain controller: lifecycle, status, node loss and teardown of ComputeDomains in the store."""
