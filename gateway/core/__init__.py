"""The generation core every API shares: reading a request body (strict models, bounds on
every list), the conversation every API translates into, and the one generation path from
prompt tokens to a worker and back."""
