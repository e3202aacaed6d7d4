"""User tools above the API: debug, the model zoo and the HTML report."""
