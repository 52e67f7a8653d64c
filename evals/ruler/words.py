"""Word lists for the RULER-style generators: a fixed subset of the lists in the `wonderwords` package
(MIT License, Copyright (c) 2020 Maxim Rebguns), which RULER itself draws keys and words from. Vendored so that
generated samples never depend on an installed package version; lowercase ASCII words of 3-10 letters."""

ADJECTIVES = """
aback abandoned abashed aberrant abhorrent aboriginal abounding absent abstracted absurd abundant acceptable
accessible accidental accurate acoustic acrid adaptable addicted adjoining adorable afraid agonizing ahead alike
alleged alluring ambiguous ambitious amuck angry animated annoyed annoying apathetic aquatic ashamed assorted
auspicious available bad bashful bawdy billowy bizarre blushing boiling boorish boring breakable bumpy busy callous
careful chilly chivalrous chubby clever cloistered coherent cold colossal combative confused crabby craven crazy
creepy cuddly cute cynical daffy damp dangerous dapper dark dashing dead deadpan deafening decisive decorous deeply
delicious demonic deranged detailed didactic difficult diligent direful discreet distinct disturbed divergent
doubtful dramatic dull dynamic eager early earthy easy educated efficient elegant enchanting erect erratic
evanescent exuberant fabulous faint fair fancy fantastic fascinated fast fearless feigned fertile fine flagrant
flaky flashy flat flawless flowery foolish forgetful fortunate fragile frail frantic fresh functional funny fuzzy
gaping gentle gleaming godly grandiose grotesque gruesome grumpy guarded gusty guttural half hallowed halting
handsome handsomely healthy heavenly helpless hesitant historical holistic homeless honorable hungry hurried husky
icy idiotic ill illegal imaginary immense imminent impartial important imported innate internal joyous juicy jumbled
juvenile kind knotty known labored lamentable languid laughable lazy lethal level lewd likeable little long longing
loose loutish lovely loving ludicrous lush lying magenta magical maniacal marked massive mature measly meek melodic
merciful mighty misty moaning modern momentous muddled muddy murky mute naive nappy nasty naughty nauseating nervous
new nifty noiseless nonchalant nosy null numerous obsolete odd offbeat organic outrageous overrated overt painful
panicky pathetic peaceful penitent periodic petite picayune piquant plastic plausible pleasant plucky possessive
precious prickly productive protective proud psychotic puffy puny purring quack quick quickest quiet racial rainy
rampant rapid raspy real rebellious receptive red redundant reflective rhetorical rich ripe ritzy robust romantic
round ruddy ruthless sable sad satisfying scientific secretive seemly selective shaggy shaky shallow sharp shiny
silent sincere skinny slimy slippery sloppy slow small smelly smiling smoggy soft soggy solid sore sparkling spicy
spiritual splendid spurious squalid square staking stale steady sticky strong stupid subdued subsequent successful
succinct sulky swanky sweet sweltering tall tame tangible tangy tart tasteful tasty tawdry telling temporary tender
tense tenuous terrible tested testy thankful thoughtful tired toothsome towering tranquil tricky trite troubled
typical ugliest ultra unadvised unarmed unbiased uncovered unequaled uneven unsightly unsuitable uppity upset utter
vague verdant victorious vigorous voiceless volatile wakeful wandering warlike warm watchful whimsical wicked
willing wiry wistful woebegone wrathful wrong wry yielding yummy zippy zonked
""".split()

NOUNS = """
aardvark abacus abbey academics accent accessory accordion achiever acid acre adult advice affect affidavit
aftermath aftershock agony aid aide album algebra alley alligator alloy alpaca altitude analog anger angiosperm
angle annual anorak antibody apology appetite apron architect area armpit arrogance artichoke ascot asphalt
assessment assistant athlete atmosphere atrium attack attendance auditorium authority avalanche average awe babushka
backburn backdrop background bacon baggage baggy band bangle banker banquette barbeque bargain barrel basket beak
beginning beret bestseller billion bin bird bitten bitter blackness blend bloomer blouse blush boar bombing bonsai
bookmark boon boost bootee bother bout bowler bowtie bracket brassiere bribery briefing brink bronze brood broom
browsing brush buckle buggy builder bulk bumper bun bureau bus bustle caffeine calf calico calorie camera camp
candelabra cannibal cannon canon caper carotene carpenter carry carter cartload casement casino cassava castle
catalogue catcher cell cellar cemetery cenotaph chamber champagne chandelier chart chauvinist checkbook cheetah
chess chief chiffonier childbirth chime chin chinchilla choir choker chow chuck cigarette circuit cirrus civilian
claim clave clavicle cleaner cleavage clef cleric client closet closure cobweb cocoa code coke coleslaw coliseum
collar collector column combat company complaint complicity composer composite conception concert conference
confusion congo conifer consent contour contrast conversion copying cord corner cornet cot cotton couch coupon
courthouse coverage cradle craftsman crane crash crayfish creative credential cricket crisis crop crush cry crystal
curd currency cuticle cymbal dahlia debate debris definition delight deodorant deposit desert designer detour
developer diabetes diagram dial dickey dictator dig digging dime dimple diploma diplomacy directory dirndl
disclaimer discount disruption distortion divine dollop dolman dome doorway drag dragonfly drawer dreamer dress
drill driver driving drunk duckling dumbwaiter duplexer duration durian earplug earth edition egghead ejector elbow
elderberry elixir email embryo emergence emergency employment enclave end endive engine entity entree equal
espadrille evidence excellence exhibition exocrine experiment extremist eyelids failure faith fame family fantasy
favor feather feature feel figurine file final fire fireman firewall flag flick floor flung flytrap following
footage footnote footstool forage forager foray ford forehead formal former fund furnace furry gaffer gale gathering
gavel gear generation geranium gesture girdle girlfriend glass gloom gnat goddess graduation grammar grand grasp
grass grassland gratitude gray greens grocery grouper grouse guarantee guard guess guideline guilty habit halt
hammock handgun handle handlebar happiness harbor hardhat hardship hare harmonize harvest hash hashtag hatbox
headline headrest heel heifer hermit hero high hiking homogenate hood hop hornet hostess howard hug hundred hurdle
hydrofoil hydrolysis hydroxyl iceberg icy ignorant impala incentive incision infection infinite influx infusion
inhibition initialise injustice inlay input instance institute insulation integer intervenor intuition invader
irrigation jade jazz jeweller joke journalist jug kazoo kielbasa killing kilometer kiosk kit kitten knight lab
labour lace ladybug lamb lambkin landform landing larva lashes latex laugh legacy lender lens lever libido library
lieutenant ligula likeness lilac lily lime limo liver loafer lobby lode login loincloth loyalty lunchroom lynx
lyrics macaroni macaroon macro macrofauna maelstrom mailing majority makeup mallet manner mansard manservant map
market marshland marxism mat material mayor mean means meantime melody meme menopause meridian merit metric
mezzanine middleman millimeter min mining minute misfit modeling modernity molar molding mole moment monotheism
monster month moody moonlight moonscape morale mortgage mosquito moth motion motor mouth mover movie mule muscat
mussel name narrative nasal native navigation nick nickel nightclub north nose novel numeracy offence oil oleo opera
opinion opium opossum opposite optimist orchestra order ore osprey other ounce outfit oval overload ozone package
paddock palace paper parachute paradise paramecium parrot parser passage passion pattypan pawnshop payee payment
peacock pendulum penguin penny people pepper pepperoni perch periodical perp pet phosphate physics physiology
pianist piccolo pie pilaf pile pink pinot pinworm piracy pizza platinum platypus playground plier plover plumber
plunger pod poisoning polo pond pony popsicle popularity porpoise port possible post pottery pound practice prairie
preface preference pride principle privilege processor produce prompt proof proposal prosecutor prosperity publisher
quest quota racing radiosonde raffle railing raiment rain rainstorm ranch ranger raspberry rations ray read
readiness rear recall recipe recreation rectangle redhead reef regard reject relief reluctance remote reporter
resolve reunion revelation rice ride rifle rim rip ripple riverbed rock roller romance roster rostrum route rug
ruler rutabaga sadness samurai satellite satire saviour savory scalp scanner scenery scout scratch sculpture seaweed
second section seep segment seller semicircle sepal serval setting settlement shallows shanty shoe shopper shorts
sibling sideboard signet silence similarity singular sir sky skywalk slavery slaw slot smuggling sneaker snowflake
snowplow snowstorm snowsuit sofa softdrink sombrero sonata sophomore soprano sorbet sort soup souvenir spaghetti
sparrow spear speech speed sphere spinach spit splendor spoon sprag sprat spree spruce stability starboard
statistics statute steward stiletto still stimulus stole story stress stud study stumbling stupidity subprime
subroutine suburb success sultan summit sun sunbeam sundial sunlamp sunshine supplier supporter surfboard surge
surrounds swallow swan swanling swell swine sympathy symptom syndicate synonym synthesis syrup talking tank tax
teepee telescreen temptation tendency tenth terrorist theme thermostat thing thistle thousand thump tights tintype
toaster tonic topic tour tourism tournament townhouse tractor transition transom trash travel tray tributary trim
trolley trumpet trustee try tuber tug tugboat tumbler turban turmeric turnip tweezers type ukulele universe
university upper upstairs usual vacation valley variation vegetable vernacular view vine violation violence virtue
visa vision vista visual vixen void vol volleyball volume vomit voting wait wallet walnut walrus wannabe warfare
warlock warming wash watercress wax weakness wealth weekend wetsuit whey wholesaler wife win wind winery wingtip
wisteria workhorse writing yeast youngster yurt zero zipper zoo zoology
""".split()

VERBS = """
accelerate accomplish acted activate add admire admit advise afford agree altered amuse annoy answer anticipate
appear appreciate approve argue arrange arrest arrive ascertain ask assemble assess assist attach attain attend
attract avoid bake balance ban bat bathe battle beam bear become behave behold bend bind bleach bleed bless blind
blush boast boil book brake breed broadcast brush build bump burst camp carry carve cast catch cause charge cheat
check choke claim clap clarify classify clear cling clip color command compare compile complain complete compose
conceive concern confront construct consult contain continue contract control convert copy correct cough create
creep cross crush cure cut deal decide define delay delegate delight desert design destroy detect develop devise
diagnose disappear dislike display disprove dissect distribute dive divide draft drag drain dramatize drip drop
drown drum dust dwell edited educate embarrass empty enacted encourage end endure enforce enhance ensure enter
establish exceed excuse exercise exhibit expect expedite experiment explode express extract face facilitate fancy
fasten feel file fill film finance fire fit flap flash flee fling flood flow fold fool force forecast forego foresee
foretell freeze fry gather gaze get give glow glue graduate grate greet grin groan guarantee guard handle handwrite
harass hate hear hide hug hunt hurt ignore illustrate imagine implement improve improvise include increase induce
injure innovate input institute instruct integrate intend intensify interest invent inventory irritate jog join
judge juggle kept kneel knit knock knot know land lay lead lecture led lend level license lie light lock lose manage
mark market marry mediate meet melt memorize mend mentor milk mine mislead misspell mix monitor mourn muddle
multiply name navigate need negotiate nest note number obey observe occur offer officiate open operate organize
oriented overdo overdraw overflow own pack park pass paste pause peck pedal peel peep perceive persuade pilot pine
place plan poke polish possess practice praised prefer prepare preset process produce profess program progress
project promise promote proofread protect prove provide publicize purchase question quit race radiate rain raise
rate reach read realign realize receive refer regret regulate reign reinforce reject rejoice relax release remain
remember remind remove render repair replace represent reproduce rescue research respond restored retrieve review
revise ride rinse risk rock rot rush sail schedule scold scrape scream scribble scrub seal seek sell send sense set
settle shade shake shape share shear shed shine shiver shock shop shrink shrug sigh sign signal simplify sink sip
ski slap slide slow smash smell sneeze snore soak soothsay sound sow spare sparkle speak specify speed spell spend
spill spoil spot spray squash squeal stain start stay steal steer step stick stimulate stir stitch strive stuff
sublet subtract suffer summarize supply suppose surprise suspect swear sweat sweep swim swing switch symbolize tame
tease telephone tell test thaw thrive tick time tip touch trade transcribe transfer translate trap tread treat trip
trot trouble tumble tutor type understand undress unfasten unify untidy update upset utilize warm wash water wave
wear wend whine win wind withdraw withstand wobble worry wriggle wring yawn zoom
""".split()
