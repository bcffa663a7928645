"""Signed bundles (issue 18): minisign-format keys and signatures, interop with the real minisign
tool both ways, the validator's "signature" stage through verify, mount, inspect, serve and pull."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz_corpus import edit_manifest, forge_cache, reseal_sums, set_path
from hypothesis import given, settings
from hypothesis import strategies as st
from test_distribute import REPO, fake_hub, model  # noqa: F401  (fixtures used by name)

from pipeline.builder.signing import sign_bundle
from pipeline.cli import main
from pipeline.cli.reports import InspectReport
from pipeline.format.bundle_folder import CACHE_FILE, MANIFEST_FILE, SIGNATURE_FILE
from pipeline.format.errors import BundleError
from pipeline.format.secret_key import (
    SecretKey,
    generate,
    parse_secret_key,
    scrypt_params,
    secret_key_text,
)
from pipeline.format.signature import (
    SignatureError,
    check,
    parse_public_key,
    parse_signature,
    read_public_key,
)
from pipeline.runtime import mount, verify

from conftest import document

ROOT = Path(__file__).resolve().parents[1]
MINISIGN = shutil.which("minisign")
# Interop with the real tool is a CI check (.ci/run installs minisign): skipped only off CI.
needs_minisign = pytest.mark.skipif(
    MINISIGN is None and os.environ.get("CI") != "true",
    reason="minisign is not installed (apt-get install minisign; CI installs it)",
)


def write_keys(folder: Path, key: SecretKey, name: str = "k") -> tuple[Path, Path]:
    """An unencrypted secret key file and its public key file, as keygen -W writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.key").write_text(secret_key_text(key, None))
    (folder / f"{name}.pub").write_text(key.public_key().file_text())
    return folder / f"{name}.key", folder / f"{name}.pub"


@pytest.fixture
def key() -> SecretKey:
    return generate()


@pytest.fixture
def bundle(tmp_path: Path, shop_bundle: Path) -> Path:
    """A copy of the shop bundle in the bundles/<name>/<version>/<model> layout, unsigned."""
    dest = tmp_path / "bundles" / "shop" / "1" / shop_bundle.name
    shutil.copytree(shop_bundle, dest)
    return dest


def minisign(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [MINISIGN, *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def comment_of(bundle: Path) -> str:
    m = json.loads((bundle / MANIFEST_FILE).read_text())
    return f"prefix-bundles shop@1 {m['model']['slug']}-{m['model']['fingerprint'][:12]}"


# --- the formats ---------------------------------------------------------------------------------


def test_key_files_round_trip_and_key_id_prints_as_minisign_does(key: SecretKey):
    text = key.public_key().file_text()
    assert text.splitlines()[0] == f"untrusted comment: minisign public key {key.public_key().id}"
    assert key.public_key().id == key.key_id[::-1].hex().upper()
    assert parse_public_key(text) == key.public_key()
    assert parse_public_key(text.splitlines()[1]) == key.public_key()  # the bare -P form
    assert parse_secret_key(secret_key_text(key, None)) == key


def test_an_encrypted_secret_key_needs_its_password(key: SecretKey):
    text = secret_key_text(key, "hunter2", opslimit=524288, memlimit=16777216)
    assert parse_secret_key(text, lambda: "hunter2") == key
    with pytest.raises(ValueError, match="^wrong password$"):
        parse_secret_key(text, lambda: "hunter3")
    with pytest.raises(ValueError, match="^it is encrypted and no password was given$"):
        parse_secret_key(text)


def test_scrypt_parameters_are_libsodiums():
    assert scrypt_params(33554432, 1073741824) == (1 << 20, 8, 1)  # minisign -G: 1 GiB
    assert scrypt_params(524288, 16777216) == (1 << 14, 8, 1)  # libsodium's interactive limits


def test_a_signature_verifies_only_over_the_exact_bytes(key: SecretKey):
    sig = key.sign(b"manifest bytes", "prefix-bundles shop@1 tiny-0123456789ab")
    parsed = parse_signature(sig.file_bytes())
    assert parsed == sig and parsed.algorithm == b"ED"
    assert check(parsed, b"manifest bytes", key.public_key()) is None
    assert "does not match the file" in check(parsed, b"manifest bytes!", key.public_key())
    other = generate().public_key()
    assert check(parsed, b"manifest bytes", other) == f"it is by key id {sig.key}, not {other.id}"


KEY_FOR_HYPOTHESIS = generate()
SIGNED = KEY_FOR_HYPOTHESIS.sign(b"m", "prefix-bundles shop@1 tiny-0123456789ab")


def signed_parts(sig) -> tuple:
    return (sig.algorithm, sig.key_id, sig.signature, sig.trusted_comment, sig.global_signature)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), position=st.integers(min_value=0), mask=st.integers(1, 255))
def test_any_bytes_are_a_signature_or_a_valueerror_and_only_the_signed_parts_verify(
    data: bytes, position: int, mask: int
):
    """Random bytes and one-byte edits of a valid file: parse_signature raises ValueError or
    returns a Signature; it verifies exactly when every signed part is unchanged (an edit in
    the untrusted comment, or in base64 padding bits, changes nothing signed)."""
    edited = bytearray(SIGNED.file_bytes())
    edited[position % len(edited)] ^= mask
    for candidate in (data, bytes(edited)):
        try:
            sig = parse_signature(candidate)
        except ValueError:
            continue
        ok = check(sig, b"m", KEY_FOR_HYPOTHESIS.public_key()) is None
        assert ok == (signed_parts(sig) == signed_parts(SIGNED))


def test_a_bad_public_key_file_is_one_error_naming_it(tmp_path: Path):
    path = tmp_path / "k.pub"
    path.write_text("untrusted comment: x\nnot base64!\n")
    with pytest.raises(SignatureError) as info:
        read_public_key(path)
    assert str(info.value) == (
        f"public key {path} is not a minisign public key (the public key line is not base64); "
        "pass the .pub file that 'prefix-bundles keygen' or 'minisign -G' wrote"
    )


# --- interop with the real minisign tool -----------------------------------------------------------


@needs_minisign
def test_a_minisign_key_signs_with_our_sign_and_minisign_verifies_it(
    bundle: Path, tmp_path: Path, tiny_model: Path, capsys
):
    pub, sec = tmp_path / "ms.pub", tmp_path / "ms.key"
    assert minisign("-G", "-W", "-p", str(pub), "-s", str(sec)).returncode == 0
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}
    assert main(["sign", str(bundle), "--key", str(sec)]) == 0
    key_id = read_public_key(pub).id
    assert capsys.readouterr().out.startswith(
        f"signed {bundle} (key id {key_id}, trusted comment {comment_of(bundle)!r})\n"
    )
    after = {p.name: p.read_bytes() for p in bundle.iterdir()}
    assert sorted(after) == sorted([*before, SIGNATURE_FILE])  # nothing else was rewritten
    assert all(after[name] == data for name, data in before.items())
    assert not [p for p in bundle.parent.iterdir() if p != bundle]  # no temporary file left
    done = minisign("-Vm", str(bundle / MANIFEST_FILE), "-p", str(pub))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"Trusted comment: {comment_of(bundle)}"
    assert main(["verify", str(bundle), "--model", str(tiny_model), "--trusted-key", str(pub)]) == 0


@needs_minisign
def test_our_keygen_keys_sign_and_verify_in_minisign(
    tmp_path: Path, bundle: Path, tiny_model: Path, capsys
):
    sec, pub = tmp_path / "ours.key", tmp_path / "ours.pub"
    assert main(["keygen", "--secret-key", str(sec), "--unencrypted"]) == 0
    key_id = read_public_key(pub).id
    assert capsys.readouterr().out.splitlines()[0] == f"key id {key_id}"
    assert oct(sec.stat().st_mode & 0o777) == "0o600"
    # minisign signs with our secret key (trusted comment as we write it); we accept it
    signed = minisign("-S", "-W", "-s", str(sec), "-m", str(bundle / MANIFEST_FILE),
                      "-t", comment_of(bundle))  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    assert verify(bundle, tiny_model, trusted_keys=[read_public_key(pub)]).prefix.name == "shop"
    # minisign's legacy (not prehashed) format verifies too
    legacy = minisign("-S", "-l", "-W", "-s", str(sec), "-m", str(bundle / MANIFEST_FILE),
                      "-t", comment_of(bundle))  # fmt: skip
    assert legacy.returncode == 0, legacy.stderr
    assert parse_signature((bundle / SIGNATURE_FILE).read_bytes()).algorithm == b"Ed"
    verify(bundle, tiny_model, trusted_keys=[read_public_key(pub)])
    # our sign, then minisign -V with our public key
    assert main(["sign", str(bundle), "--key", str(sec)]) == 0
    done = minisign("-Vm", str(bundle / MANIFEST_FILE), "-p", str(pub))
    assert done.returncode == 0, done.stderr


@needs_minisign
def test_minisigns_default_trusted_comment_is_refused_naming_the_one_to_use(
    tmp_path: Path, bundle: Path, tiny_model: Path, key: SecretKey
):
    sec, pub = write_keys(tmp_path / "keys", key)
    assert minisign("-S", "-W", "-s", str(sec), "-m", str(bundle / MANIFEST_FILE)).returncode == 0
    written = parse_signature((bundle / SIGNATURE_FILE).read_bytes()).trusted_comment
    with pytest.raises(BundleError) as info:
        verify(bundle, tiny_model, trusted_keys=[key.public_key()])
    want = comment_of(bundle)
    assert info.value.reason == (
        f"the trusted comment of {SIGNATURE_FILE} (key id {key.public_key().id}) is "
        f"{written!r}, not {want!r}: the signature was made for something else; sign this "
        f"bundle ('prefix-bundles sign', or minisign -S -t '{want}')"
    )
    assert (info.value.check, info.value.field) == ("manifest", SIGNATURE_FILE)


@needs_minisign
@pytest.mark.slow
def test_encrypted_keys_work_both_ways(tmp_path: Path, bundle: Path, tiny_model: Path, monkeypatch):
    """scrypt-encrypted secret keys (minisign's default, 1 GiB scrypt): theirs with our sign,
    ours (keygen with a password) with minisign -S."""
    monkeypatch.setenv("PREFIX_BUNDLES_KEY_PASSWORD", "correct horse")
    pub, sec = tmp_path / "ms.pub", tmp_path / "ms.key"
    made = minisign("-G", "-p", str(pub), "-s", str(sec), stdin="correct horse\ncorrect horse\n")
    assert made.returncode == 0, made.stderr
    assert main(["sign", str(bundle), "--key", str(sec)]) == 0
    verify(bundle, tiny_model, trusted_keys=[read_public_key(pub)])
    ours, ours_pub = tmp_path / "ours.key", tmp_path / "ours.pub"
    assert main(["keygen", "--secret-key", str(ours)]) == 0
    signed = minisign("-S", "-s", str(ours), "-m", str(bundle / MANIFEST_FILE),
                      "-t", comment_of(bundle), stdin="correct horse\n")  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    verify(bundle, tiny_model, trusted_keys=[read_public_key(ours_pub)])


# --- the validator's signature stage -------------------------------------------------------------


def test_unsigned_and_foreign_signatures_are_refused_naming_the_key_ids(
    bundle: Path, tiny_model: Path, key: SecretKey
):
    trusted = key.public_key()
    with pytest.raises(BundleError) as info:
        verify(bundle, tiny_model, trusted_keys=[trusted])
    assert str(info.value) == (
        f"bundle {bundle}: {SIGNATURE_FILE} is missing: every bundle must be signed by a trusted "
        f"key (trusted key id {trusted.id}); sign it ('prefix-bundles sign {bundle} --key KEY') "
        "or re-copy it with its signature"
    )
    assert (info.value.check, info.value.field) == ("signature", SIGNATURE_FILE)
    other = generate()
    sign_bundle(bundle, other)
    with pytest.raises(BundleError) as info:
        verify(bundle, tiny_model, trusted_keys=[trusted])
    assert info.value.reason == (
        f"{SIGNATURE_FILE} is signed by key id {other.public_key().id}, which is not trusted "
        f"(trusted key id {trusted.id}); sign it with a trusted key, or trust that key's .pub "
        "file with --trusted-key if it is yours"
    )
    # rotation: either of two trusted keys will do; without keys the signature is not checked
    assert verify(bundle, tiny_model, trusted_keys=[trusted, other.public_key()])
    assert verify(bundle, tiny_model)


def test_the_forged_bundle_is_refused_by_verify_and_mount_given_the_key(
    bundle: Path, tiny_model: Path, key: SecretKey, tmp_path: Path, capsys
):
    sign_bundle(bundle, key)
    _, pub = write_keys(tmp_path / "keys", key)
    assert main(["verify", str(bundle), "--model", str(tiny_model), "--trusted-key", str(pub)]) == 0
    capsys.readouterr()
    forge_cache(bundle)
    assert verify(bundle, tiny_model)  # integrity alone cannot tell (the finding)
    assert main(["verify", str(bundle), "--model", str(tiny_model), "--trusted-key", str(pub)]) == 1
    assert capsys.readouterr().err == (
        f"error: bundle {bundle}: {SIGNATURE_FILE} by key id {key.public_key().id} does not "
        f"verify over {MANIFEST_FILE}: the signature does not match the file (the file or the "
        "signature was altered); rebuild and sign the bundle again, or re-copy it\n"
    )
    result = mount(
        tiny_model, bundle.parents[2], skip_refused=True, trusted_keys=[key.public_key()]
    )
    assert not result.bundles and [r.field for r in result.refused] == [SIGNATURE_FILE]


def test_inspect_shows_the_key_id_and_trusted_comment(
    bundle: Path, key: SecretKey, tmp_path: Path, capsys
):
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "  signature: none (unsigned)\n" in out
    assert "  --   signature             not checked: no --trusted-key given\n" in out
    sign_bundle(bundle, key)
    _, pub = write_keys(tmp_path / "keys", key)
    assert main(["inspect", str(bundle), "--trusted-key", str(pub)]) == 0
    out = capsys.readouterr().out
    kid = key.public_key().id
    assert f"  signature: key id {kid}, trusted comment {comment_of(bundle)!r}\n" in out
    assert "  ok   signature             with trusted keys: manifest.json.minisig" in out
    assert main(["inspect", str(bundle), "--json", "--trusted-key", str(pub)]) == 0
    doc = document(InspectReport, capsys.readouterr().out)
    assert (doc.signature.key_id, doc.signature.trusted_comment) == (kid, comment_of(bundle))
    assert doc.signature.verified and doc.signature.problem is None
    assert {c.name: c.status for c in doc.validity.checks}["signature"] == "ok"
    assert main(["inspect", str(bundle), "--json"]) == 0
    doc = document(InspectReport, capsys.readouterr().out)
    assert not doc.signature.verified
    assert {c.name: c.status for c in doc.validity.checks}["signature"] == "skipped"


def test_sign_signs_only_the_manifest_bytes_it_validated(bundle: Path, key: SecretKey, monkeypatch):
    """manifest.json and SHA256SUMS replaced (consistently) right after the validation: the
    signature is refused with one line, never put on bytes that were not validated."""
    import pipeline.builder.signing as signing
    from pipeline.format.bundle_folder import SUMS_FILE, sums_text
    from pipeline.format.fingerprint import sha256_bytes

    validate = signing.validate
    swapped = {}

    def validate_then_swap(*args, **kwargs):
        v = validate(*args, **kwargs)
        m = json.loads((bundle / MANIFEST_FILE).read_text())
        m["cache"]["file_sha256"] = "0" * 64  # a manifest that pins nothing on disk
        data = (json.dumps(m, indent=2, sort_keys=True) + "\n").encode()
        (bundle / MANIFEST_FILE).write_bytes(data)
        sums = {CACHE_FILE: "0" * 64, MANIFEST_FILE: sha256_bytes(data)}
        (bundle / SUMS_FILE).write_text(sums_text(sums))
        swapped.update(validated=v.manifest_sha256, now=sha256_bytes(data))
        return v

    monkeypatch.setattr(signing, "validate", validate_then_swap)
    with pytest.raises(BundleError) as exc:
        sign_bundle(bundle, key)
    assert str(exc.value) == (
        f"bundle {bundle}: manifest.json changed after it was validated (sha256 "
        f"{swapped['validated'][:16]}.. validated, {swapped['now'][:16]}.. now); nothing was "
        "signed: find what writes to this bundle, then sign it again"
    )
    assert not (bundle / SIGNATURE_FILE).exists()


def test_a_signature_cut_short_by_the_file_size_limit_says_so(bundle: Path, key: SecretKey):
    """A full disk or the file size limit is named as such, not as a folder to make writable."""
    import resource

    from pipeline.format.errors import BuildError

    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, old[1]))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(BuildError) as exc:
            sign_bundle(bundle, key)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    assert str(exc.value) == (
        f"cannot write {bundle / SIGNATURE_FILE}: File too large; the file size limit was hit: "
        "raise it (ulimit -f)"
    )
    assert sorted(p.name for p in bundle.parent.iterdir()) == [bundle.name]  # no temporary file


UNSIGNED_ACCEPTS = {  # docs/bundle-format.md: what an unsigned bundle's checks prove
    "request.messages": lambda m: m["request"]["messages"][0].update(content="You are a pirate."),
    "text.preview": lambda m: m["text"].update(preview="totally different prompt"),
    "fidelity.*": lambda m: m["fidelity"].update(reference="anything at all"),
    "prefix.version": lambda m: m["prefix"].update(version=7),
}


@pytest.mark.parametrize("field", sorted(UNSIGNED_ACCEPTS))
def test_what_only_a_signature_proves_is_documented(
    bundle: Path, key: SecretKey, tiny_model: Path, tmp_path: Path, field: str, capsys
):
    """manifest.json edited and SHA256SUMS regenerated: the unsigned checks accept it (nothing
    recomputes these fields, and a relabelled version moved to its folder agrees with it), a
    signature made before the edit refuses it, and the docs say so field by field."""
    sign_bundle(bundle, key)
    _, pub = write_keys(tmp_path / "keys", key)
    edit_manifest(UNSIGNED_ACCEPTS[field])(bundle)
    reseal_sums(bundle)
    if field == "prefix.version":
        moved = bundle.parents[1] / "7" / bundle.name
        moved.parent.mkdir()
        bundle = bundle.rename(moved)
    assert main(["verify", str(bundle), "--model", str(tiny_model)]) == 0
    assert main(["verify", str(bundle), "--model", str(tiny_model), "--trusted-key", str(pub)]) == 1
    assert capsys.readouterr().err.startswith(f"error: bundle {bundle}: ")
    docs = (ROOT / "docs/bundle-format.md").read_text()
    section = docs.split("### What an unsigned bundle's checks prove")[1].split("\n## ")[0]
    assert f"`{field}`" in section


# --- the CLI: keygen, sign, keys from the environment ----------------------------------------------


def test_sign_takes_the_key_from_the_environment_and_refuses_an_invalid_bundle(
    bundle: Path, key: SecretKey, tmp_path: Path, monkeypatch, capsys
):
    assert main(["sign", str(bundle)]) == 1
    assert capsys.readouterr().err == (
        "error: no signing key: pass --key FILE or set PREFIX_BUNDLES_SIGNING_KEY to the secret "
        "key file's text\n"
    )
    monkeypatch.setenv("PREFIX_BUNDLES_SIGNING_KEY", secret_key_text(key, None))
    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    (broken / CACHE_FILE).write_bytes(b"\xff" * 64)
    assert main(["sign", str(broken), str(bundle)]) == 1
    out = capsys.readouterr()
    assert out.err.startswith(f"error: bundle {broken}: ") and out.err.endswith(" (not signed)\n")
    assert out.out.startswith(
        f"signed {bundle} (key id {key.public_key().id}, trusted comment {comment_of(bundle)!r})\n"
    )
    assert not (broken / SIGNATURE_FILE).exists()
    assert check(
        parse_signature((bundle / SIGNATURE_FILE).read_bytes()),
        (bundle / MANIFEST_FILE).read_bytes(),
        key.public_key(),
    ) is None  # fmt: skip


def test_keygen_never_overwrites_and_needs_a_password_or_the_flag(
    tmp_path: Path, capsys, monkeypatch
):
    sec = tmp_path / "k.key"
    assert main(["keygen", "--secret-key", str(sec), "-W"]) == 0
    first = sec.read_text()
    capsys.readouterr()
    assert main(["keygen", "--secret-key", str(sec), "-W"]) == 1
    assert capsys.readouterr().err == f"error: {sec} exists; pass --force to replace the key pair\n"
    assert sec.read_text() == first
    monkeypatch.delenv("PREFIX_BUNDLES_KEY_PASSWORD", raising=False)
    assert main(["keygen", "--secret-key", str(tmp_path / "e.key")]) == 1  # stdin is no terminal
    assert capsys.readouterr().err == (
        "error: no terminal can ask for the new key's password; set PREFIX_BUNDLES_KEY_PASSWORD, "
        "or pass --unencrypted for a key without one (nothing was written)\n"
    )
    assert not (tmp_path / "e.key").exists() and not (tmp_path / "e.pub").exists()


def test_keygen_checks_both_destinations_before_writing_either(tmp_path: Path, capsys):
    """A public key in a missing folder leaves no secret key behind (a rerun would be refused),
    and two spellings of one file are refused, --force or not: never a secret key overwritten
    by its public key."""
    sec = tmp_path / "a.key"
    assert (
        main(["keygen", "-W", "--secret-key", str(sec), "--public-key", str(tmp_path / "no/a.pub")])
        == 1
    )
    assert capsys.readouterr().err == (
        f"error: cannot write {tmp_path / 'no/a.pub'}: the folder {tmp_path / 'no'} does not "
        "exist; create it or pass another path (nothing was written)\n"
    )
    assert sorted(tmp_path.iterdir()) == []
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub/../a.key"
    for force in ([], ["--force"]):
        assert (
            main(["keygen", "-W", *force, "--secret-key", str(sec), "--public-key", str(other)])
            == 1
        )
        assert capsys.readouterr().err == (
            f"error: --secret-key {sec} and --public-key {other} are the same file; pass two names\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]


def test_keygen_puts_back_the_secret_key_when_the_public_key_cannot_be_placed(
    tmp_path: Path, capsys, monkeypatch
):
    """The public key file appears between the check and the write: the new secret key placed
    before it is removed again, the other file is left as it was, and no temporary file stays."""
    import pipeline.cli.keygen as keygen

    sec, pub = tmp_path / "k.key", tmp_path / "k.pub"
    stage = keygen.stage_beside

    def racing_stage(path: Path, data: bytes, mode: int) -> Path:
        if path == pub:
            pub.write_text("someone else's file")
        return stage(path, data, mode)

    monkeypatch.setattr(keygen, "stage_beside", racing_stage)
    assert main(["keygen", "-W", "--secret-key", str(sec)]) == 1
    assert capsys.readouterr().err == (
        f"error: cannot write {pub}: File exists; no key file was written or replaced\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.pub"]
    assert pub.read_text() == "someone else's file"


# --- pull carries signatures ---------------------------------------------------------------------


def test_pull_with_a_trusted_key_publishes_signed_bundles_only(
    bundle: Path, key: SecretKey, tmp_path: Path, capsys, request
):
    request.getfixturevalue("fake_hub")  # test_distribute's folder-backed hub
    deploy = request.getfixturevalue("model")
    _, pub = write_keys(tmp_path / "keys", key)
    _, stranger = write_keys(tmp_path / "keys", generate(), "stranger")
    sign_bundle(bundle, key)
    assert main(["push", str(bundle), "--repo", REPO]) == 0
    assert (
        main(["pull", "--repo", REPO, "--model", str(deploy), "--trusted-key", str(stranger)]) == 1
    )
    err = capsys.readouterr().err
    assert "is not trusted" in err and f"key id {key.public_key().id}" in err
    assert not (deploy / "prefix-bundles" / "shop").exists()
    assert main(["pull", "--repo", REPO, "--model", str(deploy), "--trusted-key", str(pub)]) == 0
    local = deploy / "prefix-bundles" / "shop" / "1" / bundle.name
    assert (local / SIGNATURE_FILE).read_bytes() == (bundle / SIGNATURE_FILE).read_bytes()
    assert mount(deploy, trusted_keys=[key.public_key()]).bundles


# --- build --sign-key, serve and rollback (real processes) -----------------------------------------


@needs_minisign
@pytest.mark.slow
def test_signed_builds_serve_and_a_forged_or_rolled_back_bundle_does_not(
    project: Path, tiny_model: Path, key: SecretKey, tmp_path: Path, capsys
):
    """build --sign-key signs before publishing (minisign verifies it); serve --trusted-key
    --lockfile mounts the locked, genuinely signed version; a forged copy is refused (logged, or
    exit 1 with --strict) and an older signed version copied back is never mounted."""
    from test_serve import server_process

    sec, pub = write_keys(tmp_path / "keys", key)
    definition = project / "prefixes" / "shop.toml"
    cli = ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles"), "build"]
    assert main([*cli, "--sign-key", str(sec), "--no-check"]) == 0
    definition.write_text(definition.read_text().replace("version = 1", "version = 2"))
    assert main([*cli, "--sign-key", str(sec), "--no-check"]) == 0
    capsys.readouterr()
    (v1,) = (project / "bundles" / "shop" / "1").iterdir()
    (v2,) = (project / "bundles" / "shop" / "2").iterdir()
    done = minisign("-Vm", str(v2 / MANIFEST_FILE), "-p", str(pub))
    assert done.returncode == 0 and f"prefix-bundles shop@2 {v2.name}" in done.stdout
    lock = project / "prefixes" / "prefixes.lock"
    deploy = tmp_path / "deploy"
    shutil.copytree(project / "bundles", deploy, ignore=shutil.ignore_patterns(".staging"))
    trust = ("--trusted-key", str(pub), "--lockfile", str(lock))
    with server_process(tiny_model, deploy, tmp_path / "ok.log", *trust):
        pass
    log = (tmp_path / "ok.log").read_text()
    assert "mounted shop@2" in log and "mounted shop@1" not in log

    forge_cache(deploy / "shop" / "2" / v2.name)  # the forged bundle, signature kept
    with server_process(tiny_model, deploy, tmp_path / "forged.log", *trust):
        pass
    log = (tmp_path / "forged.log").read_text()
    assert (
        f"refused {deploy / 'shop' / '2' / v2.name}: {SIGNATURE_FILE} by key id {key.public_key().id}"
        in log
    )
    assert "0 bundle(s) mounted, 1 refused" in log and "mounted shop@1" not in log
    strict = subprocess.run(
        [sys.executable, str(ROOT / "build.py"), "serve", "--model", str(tiny_model),
         "--bundles", str(deploy), "--strict", *trust],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert strict.returncode == 1
    assert strict.stderr.splitlines()[-1].startswith(
        f"error: bundle {deploy / 'shop' / '2' / v2.name}: {SIGNATURE_FILE} by key id "
    )
    # rollback: shop@2 gone, the genuine signed shop@1 left: the lockfile names 2, so none mounts
    shutil.rmtree(deploy / "shop" / "2")
    result = mount(tiny_model, deploy, skip_refused=True, versions={"shop": 2},
                   trusted_keys=[key.public_key()])  # fmt: skip
    assert not result.bundles and result.older == [deploy / "shop" / "1" / v1.name]
    # relabelled as version 2 (manifest edited, sums regenerated): the signature refuses it
    relabelled = deploy / "shop" / "2" / v1.name
    shutil.copytree(v1, relabelled)
    edit_manifest(set_path(("prefix", "version"), lambda v: 2))(relabelled)
    reseal_sums(relabelled)
    result = mount(tiny_model, deploy, skip_refused=True, versions={"shop": 2},
                   trusted_keys=[key.public_key()])  # fmt: skip
    assert not result.bundles and [r.field for r in result.refused] == [SIGNATURE_FILE]


# --- a signature vouches for proven bytes only (issue 22, finding 1) --------------------------------


def _build_cli(project: Path, *extra: str) -> list[str]:
    roots = ["--prefixes", str(project / "prefixes"), "--bundles", str(project / "bundles")]
    return [*roots, "build", "--no-check", *extra]


@pytest.mark.parametrize(
    "signed_first", [True, False], ids=["signed-then-forged", "unsigned-forged"]
)
def test_build_sign_key_never_signs_a_forged_up_to_date_bundle(
    project: Path, tiny_model: Path, key: SecretKey, tmp_path: Path, capsys, signed_first: bool
):
    """The issue's attack: a built bundle, one K/V byte edited, pins and sums rewritten; the
    release build run again must not put a valid signature on it."""
    sec, pub = write_keys(tmp_path / "keys", key)
    first = ["--sign-key", str(sec)] if signed_first else []
    assert main(_build_cli(project, *first)) == 0
    (bundle,) = (project / "bundles" / "shop" / "1").iterdir()
    forge_cache(bundle)
    before = (bundle / SIGNATURE_FILE).read_bytes() if signed_first else None
    capsys.readouterr()
    assert main(_build_cli(project, "--sign-key", str(sec))) == 1
    err = capsys.readouterr().err
    assert f"{bundle}: {CACHE_FILE} differs from what this build produces from token 0" in err
    assert "is not signed" in err and err.count("error:") == 1
    after = (bundle / SIGNATURE_FILE).read_bytes() if (bundle / SIGNATURE_FILE).exists() else None
    assert after == before  # nothing was signed
    with pytest.raises(BundleError):
        verify(bundle, tiny_model, trusted_keys=[key.public_key()])


def test_build_sign_key_signs_a_genuine_unsigned_bundle_after_rebuilding_it(
    project: Path, tiny_model: Path, key: SecretKey, tmp_path: Path, capsys
):
    sec, _ = write_keys(tmp_path / "keys", key)
    assert main(_build_cli(project)) == 0
    (bundle,) = (project / "bundles" / "shop" / "1").iterdir()
    cache_before = (bundle / CACHE_FILE).read_bytes()
    capsys.readouterr()
    assert main(_build_cli(project, "--sign-key", str(sec))) == 0
    out = capsys.readouterr().out
    assert (
        f"up to date ({bundle}); signed with key id {key.public_key().id}: rebuilt from token 0 and compared"
        in out
    )
    assert (bundle / CACHE_FILE).read_bytes() == cache_before
    assert verify(bundle, tiny_model, trusted_keys=[key.public_key()])
    # signed by this key and unchanged: the next release build proves it by the signature alone
    assert main(_build_cli(project, "--sign-key", str(sec))) == 0
    assert "rebuilt" not in capsys.readouterr().out


def test_sign_refuses_a_bundle_whose_own_signature_no_longer_verifies(
    bundle: Path, key: SecretKey, tmp_path: Path, capsys
):
    sec, _ = write_keys(tmp_path / "keys", key)
    assert main(["sign", str(bundle), "--key", str(sec)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    assert "  vouches for: manifest.json sha256 " in out
    assert f"pins {CACHE_FILE} sha256 {manifest['cache']['file_sha256'][:16]}.." in out
    assert "not checked: that the cache is what the model computes" in out
    assert main(["sign", str(bundle), "--key", str(sec)]) == 0  # valid: nothing rewritten
    assert capsys.readouterr().out.startswith(f"already signed {bundle}")
    forge_cache(bundle)
    for extra in ([], ["--replace"]):
        assert main(["sign", str(bundle), "--key", str(sec), *extra]) == 1
        assert capsys.readouterr().err == (
            f"error: bundle {bundle}: its {SIGNATURE_FILE} by this key (id {key.public_key().id}) "
            "does not verify: the bundle changed after it was signed; rebuild it with 'prefix-bundles "
            "build --force --sign-key KEY' instead of signing what is there (not signed)\n"
        )


def test_sign_over_another_keys_signature_needs_replace_also_after_pull(
    bundle: Path, key: SecretKey, tmp_path: Path, capsys, request
):
    """A pulled bundle carries its publisher's signature: re-signing it is an explicit choice."""
    request.getfixturevalue("fake_hub")
    deploy = request.getfixturevalue("model")
    publisher = generate()
    sign_bundle(bundle, publisher)
    _, pub = write_keys(tmp_path / "keys", publisher, "publisher")
    assert main(["push", str(bundle), "--repo", REPO]) == 0
    assert main(["pull", "--repo", REPO, "--model", str(deploy), "--trusted-key", str(pub)]) == 0
    local = deploy / "prefix-bundles" / "shop" / "1" / bundle.name
    sec, _ = write_keys(tmp_path / "keys", key)
    capsys.readouterr()
    assert main(["sign", str(local), "--key", str(sec)]) == 1
    assert capsys.readouterr().err == (
        f"error: bundle {local}: it is already signed by another key (id "
        f"{publisher.public_key().id}); pass --replace to put this key's (id "
        f"{key.public_key().id}) signature in its place (not signed)\n"
    )
    assert main(["sign", str(local), "--key", str(sec), "--replace"]) == 0
    assert f"replacing key id {publisher.public_key().id}'s signature" in capsys.readouterr().out
    assert verify(local, deploy, trusted_keys=[key.public_key()])
