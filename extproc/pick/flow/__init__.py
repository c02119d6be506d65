"""Flow control: hold, order and shed requests per tenant while a pool is saturated."""
