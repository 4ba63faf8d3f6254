//! docs/design.md's crate map and architecture diagram against the workspace: every member
//! of `[workspace] members` (Cargo.toml) has a row in the crate map (the first table under
//! `### Crate map`, one row per member: `` | `folder/` | `package` ... ``) naming the package
//! its own Cargo.toml names, every row is a member, and every member's package appears in the
//! architecture diagram (the first ```` ```text ```` block under `## Architecture`). A crate
//! added, renamed, moved or removed without the map following fails here, naming it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The workspace members (folders), as `Cargo.toml` lists them.
fn members(manifest: &str) -> Vec<String> {
    let t: toml::Table = toml::from_str(manifest).expect("Cargo.toml parses");
    t["workspace"]["members"]
        .as_array()
        .expect("[workspace] members is an array")
        .iter()
        .map(|m| m.as_str().expect("a member is a string").to_owned())
        .collect()
}

/// The package `folder/Cargo.toml` names.
fn package_of(folder: &str) -> String {
    let path = root().join(folder).join("Cargo.toml");
    let t: toml::Table = toml::from_str(&read(&path)).expect("a member's Cargo.toml parses");
    t["package"]["name"]
        .as_str()
        .expect("[package] name")
        .to_owned()
}

/// The text from the line `heading` to the next heading of the same or a higher level.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let level = heading.split(' ').next().unwrap_or("");
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("docs/design.md has no line {heading:?}"))
        + 1;
    let body = &doc[start + heading.len()..];
    let end = body
        .lines()
        .scan(0, |at, l| {
            let here = *at;
            *at += l.len() + 1;
            Some((here, l))
        })
        .find(|(_, l)| {
            let hashes = l.chars().take_while(|&c| c == '#').count();
            hashes > 0 && hashes <= level.len() && l[hashes..].starts_with(' ')
        })
        .map_or(body.len(), |(at, _)| at);
    &body[..end]
}

/// The crate map: (folder, package) per row of the first table of `### Crate map`.
fn crate_map(doc: &str) -> Vec<(String, String)> {
    let table = section(doc, "### Crate map")
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'));
    let mut rows = Vec::new();
    for line in table {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (Some(dir), Some(package)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        // The header and the separator have no backticked folder.
        let Some(folder) = dir
            .strip_prefix('`')
            .and_then(|d| d.strip_suffix('`'))
            .and_then(|d| d.strip_suffix('/'))
        else {
            continue;
        };
        let package = package
            .split('`')
            .nth(1)
            .unwrap_or_else(|| panic!("crate map row {folder}: no `package` in {package:?}"));
        rows.push((folder.to_owned(), package.to_owned()));
    }
    rows
}

/// The architecture diagram: the first ```text block of `## Architecture`.
fn diagram(doc: &str) -> &str {
    let arch = section(doc, "## Architecture");
    let start = arch
        .find("```text\n")
        .expect("## Architecture has a ```text diagram")
        + "```text\n".len();
    let len = arch[start..].find("```").expect("the diagram's block ends");
    &arch[start..start + len]
}

/// Every way `map` and `diagram` disagree with the workspace's `members` (folder -> package).
fn disagreements(
    members: &BTreeMap<String, String>,
    map: &[(String, String)],
    diagram: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut rows: BTreeMap<&str, &str> = BTreeMap::new();
    for (folder, package) in map {
        if rows.insert(folder, package).is_some() {
            out.push(format!("the crate map has two rows for `{folder}/`"));
        }
    }
    for (folder, package) in members {
        match rows.get(folder.as_str()) {
            None => out.push(format!(
                "workspace member `{folder}/` ({package}) has no row in the crate map"
            )),
            Some(&p) if p != package => out.push(format!(
                "the crate map says `{folder}/` is package `{p}`, its Cargo.toml says `{package}`"
            )),
            Some(_) => {}
        }
    }
    for folder in rows.keys() {
        if !members.contains_key(*folder) {
            out.push(format!(
                "the crate map has a row for `{folder}/`, which is not a workspace member"
            ));
        }
    }
    let words: Vec<&str> = diagram
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .collect();
    for (folder, package) in members {
        if !words.contains(&package.as_str()) {
            out.push(format!(
                "workspace member `{folder}/` ({package}) is not in the architecture diagram"
            ));
        }
    }
    out
}

#[test]
fn the_crate_map_and_the_diagram_are_the_workspace() {
    let root = root();
    let members: BTreeMap<String, String> = members(&read(&root.join("Cargo.toml")))
        .into_iter()
        .map(|m| {
            let p = package_of(&m);
            (m, p)
        })
        .collect();
    assert!(members.len() >= 10, "{members:?}");
    let doc = read(&root.join("docs/design.md"));
    let map = crate_map(&doc);
    let problems = disagreements(&members, &map, diagram(&doc));
    assert!(
        problems.is_empty(),
        "docs/design.md and the workspace disagree:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn a_missing_extra_or_misnamed_row_is_named() {
    let members: BTreeMap<String, String> = [("a", "pkg-a"), ("b", "pkg-b")]
        .into_iter()
        .map(|(f, p)| (f.to_owned(), p.to_owned()))
        .collect();
    let doc = "x\n## Architecture\n\n```text\n pkg-a (a/)   pkg-b\n```\n\n### Crate map\n\n\
               | directory | package |\n|---|---|\n| `a/` | `pkg-a` (a library) |\n\
               | `c/` | `pkg-c` |\n| `b/` | `pkg-x` |\n\nBeside:\n\n| `d/` | x |\n\
               ### Next\n";
    let map = crate_map(doc);
    assert_eq!(
        map,
        [("a", "pkg-a"), ("c", "pkg-c"), ("b", "pkg-x")].map(|(f, p)| (f.to_owned(), p.to_owned()))
    );
    let p = disagreements(&members, &map, diagram(doc));
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p[0].contains("`b/` is package `pkg-x`"), "{p:?}");
    assert!(
        p[1].contains("`c/`, which is not a workspace member"),
        "{p:?}"
    );
    // A member without a row, and a package not in the diagram.
    let p = disagreements(&members, &map[..1], " pkg-a ");
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p[0].contains("`b/` (pkg-b) has no row"), "{p:?}");
    assert!(p[1].contains("not in the architecture diagram"), "{p:?}");
}
