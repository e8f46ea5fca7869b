"""
Config files and --key=value flags, read as data and never executed.

    python train.py config/train_small.py --batch_size=32 --compile=True

Each script keeps its defaults as a dict of plain values (train.py: the commented globals at its top).
Arguments are applied in order: config files (a .py file of literal assignments such as
`n_layer = 6`), then flags; a config file that sets a key an earlier flag set is an error (the flag would
silently lose). An unknown key is an error naming it and the closest real key (a config file most of whose keys
are unknown: an error saying it looks like another script's; a missing one: the path meant, config/NAME.py); a
value of the wrong type is an error naming the key, the value and the expected type. An int is accepted where
a float is expected; bools are written True/False. --help (or -h), wherever it stands, prints every key
with its default and, given the script's source, the comment beside it there (key_comments).
"""
import ast
import difflib
import os
import sys
import tokenize


class ConfigError(ValueError):
    pass


LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)  # ast.literal_eval's, documented


def _check_key(key, defaults, where):
    if key not in defaults:
        close = difflib.get_close_matches(key, list(defaults), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown config key '{key}' in {where}{hint}")


def _check_type(key, value, default, where):
    expected = type(default)
    if expected is float and type(value) is int:
        try:
            return float(value)
        except OverflowError:  # an integer past float's range (1e308): a traceback otherwise
            raise ConfigError(f"config key '{key}' in {where}: an integer of {len(str(abs(value)))} digits is "
                              f"beyond a float's range") from None
    if type(value) is not expected:  # bool is a subclass of int: compare exact types
        raise ConfigError(f"config key '{key}' in {where}: got {value!r} ({type(value).__name__}), "
                          f"expected {expected.__name__} (default {default!r})"
                          + (": write True or False" if expected is bool else ''))
    return value


def _parse_flag_value(text, default):
    try:
        value = ast.literal_eval(text)
    except LITERAL_ERRORS:
        return text  # a string key's text as written; any other key's, a type error in _check_type
    return text if isinstance(default, str) and not isinstance(value, str) else value  # a quoted string is fine


def read_config_file(path):
    """The {key: value} pairs of a config file made of literal assignments."""
    if not os.path.isfile(path):
        near = [p for p in (path + '.py', os.path.join('config', path), os.path.join('config', path + '.py'))
                if os.path.isfile(p)]  # the name as typed without its folder or its .py
        raise ConfigError(f"config file '{path}' " + ("is a directory" if os.path.isdir(path) else "does not exist")
                          + (f"; did you mean '{near[0]}'?" if near else ''))
    try:
        with open(path, encoding='utf-8-sig') as f:  # -sig: a BOM, as some editors write, is dropped
            source = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start})") from None
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise ConfigError(f"config file '{path}' line {e.lineno}: {e.msg}") from None
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise ConfigError(f"config file '{path}' line {node.lineno}: only `name = literal` "
                              f"assignments are allowed, got: {ast.get_source_segment(source, node)}")
        try:
            values[node.targets[0].id] = ast.literal_eval(node.value)
        except LITERAL_ERRORS:  # TypeError: {[1]: 2}, unhashable
            raise ConfigError(f"config file '{path}' line {node.lineno}: the value of "
                              f"'{node.targets[0].id}' is not a literal (expressions are not "
                              f"evaluated): {ast.get_source_segment(source, node.value)}") from None
    return values


def key_comments(path):
    """{key: comment} of the source file that sets a script's defaults: the comment on the line of a key's first
    `key = value` (or `key=value,` inside dict(...)), with the comment-only lines under it, at its column."""
    with open(path, encoding='utf-8') as f:
        tokens = [t for t in tokenize.generate_tokens(f.readline) if t.type not in (tokenize.INDENT, tokenize.DEDENT)]
    comments, seen, keys, last = {}, set(), [], None  # keys: first set on this line; last: (keys, comment column)
    for i, t in enumerate(tokens):
        if t.type == tokenize.NAME and i + 1 < len(tokens) and tokens[i + 1].string == '=' and t.string not in seen:
            seen.add(t.string)
            keys.append(t.string)
        elif t.type == tokenize.COMMENT:
            text = t.string.lstrip('#').strip()
            if keys:
                comments.update((k, text) for k in keys)
                last = (keys, t.start[1])
            elif last and t.start[1] == last[1] and tokens[i - 1].type in (tokenize.NL, tokenize.NEWLINE):
                for k in last[0]:
                    comments[k] += ' ' + text  # a comment-only line under the last one, at its column
            else:
                last = None
        elif t.type in (tokenize.NEWLINE, tokenize.NL):
            if not keys and tokens[i - 1].type != tokenize.COMMENT:
                last = None  # a line of code that sets no key, or a blank line, ends a comment
            keys = []
    return comments


def configure(defaults, argv, source=None):
    """Apply config files and --key=value flags from argv, in order, to a copy of defaults. source: the file that
    sets the defaults, whose comments --help shows."""
    if '--help' in argv or '-h' in argv:  # wherever it is: the other arguments are not read, nor their errors
        notes = key_comments(source) if source else {}
        try:
            print("arguments: config files (`key = value` lines), then --key=value flags. The keys, with their "
                  "defaults:\n" + '\n'.join(f"  {k} = {v!r}" + (f"  # {notes[k]}" if notes.get(k) else '')
                                             for k, v in defaults.items()), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader has what it wanted (the recipe of Python's docs)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    config, flags = dict(defaults), {}
    for arg in argv:
        if arg.startswith('--'):
            key, sep, text = arg[2:].partition('=')
            if not sep:
                raise ConfigError(f"flag '{arg}' has no value: write --{key}=VALUE")
            _check_key(key, defaults, f"flag '{arg}'")
            value = _parse_flag_value(text, defaults[key])
            config[key], flags[key] = _check_type(key, value, defaults[key], f"flag '{arg}'"), arg
        else:
            values = read_config_file(arg)
            unknown = [k for k in values if k not in defaults]
            if len(unknown) > 2 and 2 * len(unknown) > len(values):  # most of it: a file for another script
                raise ConfigError(f"config file '{arg}' sets {len(unknown)} keys this script does not have ("
                                  f"{', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''}): another script's "
                                  f"config? --help lists this one's keys")
            for key, value in values.items():
                _check_key(key, defaults, f"config file '{arg}'")
                if key in flags:
                    raise ConfigError(f"config file '{arg}' sets '{key}', which the flag '{flags[key]}' before it "
                                      f"set: arguments apply in order, so put config files before flags")
                config[key] = _check_type(key, value, defaults[key], f"config file '{arg}'")
    return config
