// Builds the chat page and the admin console into src/kvik/web/static (run by `make web`).
// Output: index.html and console.html with the hashed asset names filled in, assets/ with
// content-hashed bundles plus .br and .gz siblings (the server picks one per request), the
// third-party licence texts (*.LEGAL.txt), and build-info.json with every file's sizes.
// The output is a pure function of the sources and package-lock.json: never edit it by hand.
import * as esbuild from 'esbuild';
import {mkdir, readFile, rm, writeFile, readdir} from 'node:fs/promises';
import {createHash} from 'node:crypto';
import path from 'node:path';
import {fileURLToPath} from 'node:url';
import zlib from 'node:zlib';

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.resolve(here, '../src/kvik/web/static');
const assets = path.join(out, 'assets');
const PAGES = [
  {template: 'src/chat.html', output: 'index.html', entry: 'chat'},
  {template: 'src/console.html', output: 'console.html', entry: 'console'},
];

await rm(out, {recursive: true, force: true});
await mkdir(assets, {recursive: true});

const result = await esbuild.build({
  absWorkingDir: here,
  entryPoints: {chat: 'src/chat/main.js', console: 'src/console/main.js'},
  bundle: true,
  minify: true,
  format: 'esm',
  target: ['chrome111', 'firefox115', 'safari16.4'],
  outdir: assets,
  entryNames: '[name]-[hash]',
  assetNames: '[name]-[hash]',
  legalComments: 'external',
  metafile: true,
  logLevel: 'warning',
  charset: 'utf8',
});

// entry name -> hashed file names of its JS and CSS
const names = {};
for (const [file, info] of Object.entries(result.metafile.outputs)) {
  const base = path.basename(file);
  if (info.entryPoint) {
    const entry = Object.entries({chat: 'src/chat/main.js', console: 'src/console/main.js'})
      .find(([, source]) => source === info.entryPoint)?.[0];
    if (entry) {
      names[`${entry}.js`] = base;
      if (info.cssBundle) names[`${entry}.css`] = path.basename(info.cssBundle);
    }
  }
}

// The favicon, content-hashed like the bundles.
const favicon = await readFile(path.join(here, 'src/favicon.svg'));
const faviconName = `favicon-${createHash('sha256').update(favicon).digest('hex').slice(0, 8)}.svg`;
await writeFile(path.join(assets, faviconName), favicon);
names['favicon.svg'] = faviconName;

for (const page of PAGES) {
  let html = await readFile(path.join(here, page.template), 'utf8');
  html = html.replace(/\{\{([\w.]+)\}\}/g, (match, key) => {
    if (!names[key]) throw new Error(`${page.template}: no built asset for ${match}`);
    return names[key];
  });
  await writeFile(path.join(out, page.output), html);
}

// The licences of the npm packages inside the bundles, shipped beside them.
const packages = new Map();
for (const input of Object.keys(result.metafile.inputs)) {
  const at = input.lastIndexOf('node_modules/');
  if (at < 0) continue;
  const name = input.slice(at + 'node_modules/'.length).match(/^((?:@[^/]+\/)?[^/]+)\//)?.[1];
  if (name) packages.set(name, path.join(here, input.slice(0, at), 'node_modules', name));
}
const licences = [];
for (const [name, dir] of [...packages].sort()) {
  const pkg = JSON.parse(await readFile(path.join(dir, 'package.json'), 'utf8'));
  const licenceFile = (await readdir(dir)).find((f) => /^(licen[cs]e|copying)(\.|$)/i.test(f));
  const text = licenceFile ? await readFile(path.join(dir, licenceFile), 'utf8') : `Licence: ${pkg.license}`;
  licences.push(`${name} ${pkg.version} (${pkg.license})\n${'-'.repeat(60)}\n${text.trim()}\n`);
}
await writeFile(path.join(assets, 'THIRD_PARTY_LICENSES.txt'), `${licences.join('\n\n')}\n`);

// Precompressed copies: brotli at its best setting, gzip at 9; the server never compresses assets.
const info = {files: {}};
for (const name of (await readdir(assets)).sort()) {
  const file = path.join(assets, name);
  const raw = await readFile(file);
  const entry = {bytes: raw.length};
  if (/\.(js|css|svg|txt|json)$/.test(name)) {
    const br = zlib.brotliCompressSync(raw, {params: {[zlib.constants.BROTLI_PARAM_QUALITY]: 11}});
    const gz = zlib.gzipSync(raw, {level: 9});
    await writeFile(`${file}.br`, br);
    await writeFile(`${file}.gz`, gz);
    entry.br = br.length;
    entry.gzip = gz.length;
  }
  info.files[name] = entry;
}
for (const page of PAGES) {
  const raw = await readFile(path.join(out, page.output));
  info.files[page.output] = {bytes: raw.length, gzip: zlib.gzipSync(raw, {level: 9}).length};
}
info.pages = Object.fromEntries(PAGES.map((p) => [p.output, [names[`${p.entry}.js`], names[`${p.entry}.css`], faviconName]]));
await writeFile(path.join(out, 'build-info.json'), `${JSON.stringify(info, null, 2)}\n`);

for (const page of PAGES) {
  const files = [page.output, ...info.pages[page.output]];
  const gzip = files.reduce((sum, f) => sum + (info.files[f].gzip ?? info.files[f].bytes), 0);
  console.log(`${page.output}: ${files.length} files, ${(gzip / 1024).toFixed(1)} KiB gzip on first load`);
}
